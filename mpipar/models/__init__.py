"""The models: the GPT described once (``spec``) and built for any tp mode (``gpt``), the MLP
(``mlp``), what both count (``counts``: parameters, FLOPs, stored activations), where a
pipeline cuts them (``bounds``). ``build_model`` is the entry point."""

from __future__ import annotations

from ..config import MODEL_KINDS
from .bounds import stage_bounds, unit_count, unit_weights
from .counts import UnitCounts, gpt_counts, param_count
from .gpt import build_block, build_gpt, check_gpt_shapes, gpt_block
from .mlp import build_mlp, check_mlp_shapes
from .model import Model, full_size
from .spec import GPTDims, gpt_units

_BUILDERS = {"gpt": build_gpt, "mlp": build_mlp}
assert set(_BUILDERS) == set(MODEL_KINDS), "config.MODEL_KINDS and the builders here must agree"


def build_model(mcfg, backend, seed=0, tp=None) -> Model:
    """This rank's shard of the model ``mcfg`` describes, for the tp context ``tp`` (any mode;
    the one-rank model when None)."""
    if mcfg.kind not in _BUILDERS:
        raise ValueError(f"model.kind = {mcfg.kind!r}: use one of {', '.join(MODEL_KINDS)}")
    if mcfg.kind != "gpt" and tp is not None and tp.mode != "1d":
        raise ValueError(f"tp_mode {tp.mode} builds the GPT only (model.kind = "
                         f"{mcfg.kind!r}): use tp_mode 1d")
    return _BUILDERS[mcfg.kind](mcfg, backend, seed, tp)


__all__ = ["GPTDims", "Model", "UnitCounts", "build_block", "build_gpt", "build_mlp",
           "build_model", "check_gpt_shapes", "check_mlp_shapes", "full_size", "gpt_block",
           "gpt_counts", "gpt_units", "param_count", "stage_bounds", "unit_count",
           "unit_weights"]
