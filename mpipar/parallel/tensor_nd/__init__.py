"""Tensor parallelism beyond Megatron's 1D: 2D (Optimus / SUMMA). One file per concern:
``context`` (the grid position and the mode factory), ``summa`` (the three block products),
``layers2d`` (linear, LayerNorm, embeddings, loss on q x q blocks), ``gpt2d`` (the model)."""

from .context import TP2DContext, tp_context
from .gpt2d import build_gpt_2d, check_gpt_shapes_2d

__all__ = ["TP2DContext", "tp_context", "build_gpt_2d", "check_gpt_shapes_2d"]
