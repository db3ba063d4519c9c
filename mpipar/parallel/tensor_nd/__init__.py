"""Tensor parallelism beyond Megatron's 1D: 2D (Optimus / SUMMA), 2.5D (Tesseract) and 3D.
One file per concern: ``context`` (the 2D / 2.5D grid position and the mode factory),
``summa`` (the three block products), ``layers2d`` (linear, LayerNorm, embeddings, loss on q x q
blocks, d layers deep for 2.5D), ``factory2d`` (those layers for the model description);
``context3d``, ``layers3d``, ``factory3d`` for the q x q x q cube.

``layer_factory`` hands ``mpipar.models`` the layers of a context's mode (1D's from
``parallel.tensor``); the block itself is described once, in ``mpipar.models.spec``."""

from ..tensor import Megatron1DLayers
from .context import TP2DContext, tp_context
from .context3d import TP3DContext
from .factory2d import Optimus2DLayers
from .factory3d import Cube3DLayers

FACTORIES = {"1d": Megatron1DLayers, "2d": Optimus2DLayers, "2.5d": Optimus2DLayers,
             "3d": Cube3DLayers}


def layer_factory(tp, pf):
    """The layers of ``tp.mode`` on this rank, making parameters with ``pf``."""
    return FACTORIES[tp.mode](tp, pf)


__all__ = ["FACTORIES", "Cube3DLayers", "Megatron1DLayers", "Optimus2DLayers", "TP2DContext",
           "TP3DContext", "layer_factory", "tp_context"]
