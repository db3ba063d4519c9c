"""Pure math on an array module (no MPI): kernels, layers, losses, optimizers.

``Layer`` and ``Sequential`` are re-exported here (``from mpipar.nn import Sequential``), loaded
on first use so that importing one submodule (``mpipar.nn.params``) does not load the layers.
"""

__all__ = ["Layer", "Sequential"]


def __getattr__(name):
    if name == "Layer":
        from .base import Layer
        return Layer
    if name == "Sequential":
        from .sequential import Sequential
        return Sequential
    raise AttributeError(f"module 'mpipar.nn' has no attribute {name!r}")
