"""mpipar: hand-written MLP and GPT training split across MPI ranks (tensor, pipeline, data)."""

__version__ = "0.1.0"
