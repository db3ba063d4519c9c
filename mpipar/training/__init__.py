"""Training: config -> grid -> model shard -> schedule -> optimizer -> tracer.

``preflight`` validates a config against the world and the model and builds the schedule once;
``Trainer`` runs one step on this rank; ``run`` is the whole run (``mpipar train``). Each step:
the global batch (deterministic from seed and step) is cut into this replica's rows and into
micro-batches (``batches``); the pipeline executor runs this rank's action list and reports
gradients to the data-parallel ``GradSync`` (tp partial sums, then dp buckets); the global
gradient norm is clipped; the optimizer steps.
"""

from .batches import Batches, local_microbatches, split_rows
from .loop import prepare_data, run
from .preflight import check_model, make_schedule, preflight
from .trainer import ChunkOptimizers, Trainer, chunk_bounds, make_optimizer, step_lr

__all__ = [
    "Batches", "ChunkOptimizers", "Trainer", "check_model", "chunk_bounds", "local_microbatches",
    "make_optimizer", "make_schedule", "preflight", "prepare_data", "run", "split_rows",
    "step_lr",
]
