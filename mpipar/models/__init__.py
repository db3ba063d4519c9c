"""The models: the GPT described once (``spec``) and built for any tp mode (``gpt``), the MLP
(``mlp``), what both count (``counts``: parameters, FLOPs, stored activations), where a
pipeline cuts them (``bounds``). ``build_model`` is the entry point.

The names below are imported when first used (PEP 562), so that what only counts a model (the
analysis of a timing dump, the planner) does not import the layers, the tensor-parallel
wrappers and the MPI layer that building one needs."""

from __future__ import annotations

import importlib

# name -> the submodule that defines it
_HOMES = {
    "stage_bounds": "bounds", "unit_count": "bounds", "unit_weights": "bounds",
    "UnitCounts": "counts", "gpt_counts": "counts", "param_count": "counts",
    "build_block": "gpt", "build_gpt": "gpt", "check_gpt_shapes": "gpt", "gpt_block": "gpt",
    "build_mlp": "mlp", "check_mlp_shapes": "mlp",
    "Model": "model", "full_size": "model",
    "GPTDims": "spec", "gpt_units": "spec",
}


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later look-ups find it directly
    return value


def _builders() -> dict:
    from ..config import MODEL_KINDS
    from .gpt import build_gpt
    from .mlp import build_mlp

    builders = {"gpt": build_gpt, "mlp": build_mlp}
    assert set(builders) == set(MODEL_KINDS), "config.MODEL_KINDS and the builders must agree"
    return builders


def build_model(mcfg, backend, seed=0, tp=None):
    """This rank's shard of the model ``mcfg`` describes, for the tp context ``tp`` (any mode;
    the one-rank model when None): a ``Model``."""
    from ..config import MODEL_KINDS

    if mcfg.kind not in MODEL_KINDS:
        raise ValueError(f"model.kind = {mcfg.kind!r}: use one of {', '.join(MODEL_KINDS)}")
    if mcfg.kind != "gpt" and tp is not None and tp.mode != "1d":
        raise ValueError(f"tp_mode {tp.mode} builds the GPT only (model.kind = "
                         f"{mcfg.kind!r}): use tp_mode 1d")
    return _builders()[mcfg.kind](mcfg, backend, seed, tp)


__all__ = ["build_model", *_HOMES]
