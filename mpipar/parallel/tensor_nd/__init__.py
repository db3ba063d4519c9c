"""Tensor parallelism beyond Megatron's 1D: 2D (Optimus / SUMMA), 2.5D (Tesseract) and 3D.
One file per concern: ``context`` (the 2D / 2.5D grid position and the mode factory),
``summa`` (the three block products), ``layers2d`` (linear, LayerNorm, embeddings, loss on q x q
blocks, d layers deep for 2.5D), ``gpt2d``; ``context3d``, ``layers3d``, ``gpt3d`` for the
q x q x q cube."""

from .context import TP2DContext, tp_context
from .context3d import TP3DContext
from .gpt2d import build_gpt_2d, check_gpt_shapes_2d
from .gpt3d import build_gpt_3d, check_gpt_shapes_3d


def build_gpt_nd(mcfg, backend, seed, tp):
    """The GPT of the tp context's mode (2d, 2.5d or 3d)."""
    if tp.mode == "3d":
        return build_gpt_3d(mcfg, backend, seed, tp)
    return build_gpt_2d(mcfg, backend, seed, tp)


def check_gpt_shapes_nd(m, mode: str, shape: tuple) -> None:
    """Raise ValueError naming the field when the model does not cut over the tp grid."""
    if mode == "3d":
        check_gpt_shapes_3d(m, shape[0])
    else:
        check_gpt_shapes_2d(m, shape[-1], mode)


__all__ = ["TP2DContext", "TP3DContext", "tp_context", "build_gpt_nd", "check_gpt_shapes_nd",
           "build_gpt_2d", "check_gpt_shapes_2d", "build_gpt_3d", "check_gpt_shapes_3d"]
