"""Uneven pipeline stages from measured time: a layout string for the next run, from a dump.

The dump times each compute (F, B, W, BW, recompute R, LOSS) per global chunk. A chunk's mean
time per step is spread over its units in proportion to the units' parameter counts (the
trainer's ``params`` weights; within one chunk that is the only finer information the dump
does not have), and those per-unit costs are cut into the requested number of stages by the same
min-max contiguous split as ``parallel.partition = cost``. The answer is a Megatron layout
string (``parallel.layout``), so the cut can be read, edited and passed to ``--layout``.
"""

from __future__ import annotations

import numpy as np

from ..parallel.pipeline.stage_layout import layout_string

COMPUTE_KINDS = ("F", "B", "W", "BW", "R", "LOSS")


def chunk_times(run) -> dict[int, float]:
    """{global chunk: mean compute seconds per step} on the dp = 0, tp = 0 replica (steps after
    the first when there are several: the first pays one-off allocations)."""
    steps = run.steps()
    keep = steps[1:] if len(steps) > 1 else steps
    out: dict[int, float] = {}
    for r, ev in enumerate(run.events):
        c = run.coord(r)
        if c["dp"] or c["tp"]:
            continue
        sel = ev[np.isin(ev["kind"], COMPUTE_KINDS) & np.isin(ev["step"], keep)
                 & (ev["chunk"] >= 0)]
        for chunk in np.unique(sel["chunk"]):
            part = sel[sel["chunk"] == chunk]
            out[int(chunk)] = float(np.sum(part["end"] - part["start"])) / max(len(keep), 1)
    return out


def _config_of(run):
    from ..config import load_config

    flat = {f"{sec}.{k}": v for sec, body in run.config.items() if isinstance(body, dict)
            for k, v in body.items() if not isinstance(v, (dict, list)) or k == "boundaries"}
    return load_config(None, flat)


def unit_costs(run) -> tuple[list[float], list[str]]:
    """(cost per pipeline unit, its layout symbol E / t / L) of the run's GPT."""
    from ..models import stage_bounds, unit_count, unit_weights
    from ..parallel.pipeline.build import run_schedule

    cfg = _config_of(run)
    if cfg.model.kind != "gpt":
        raise ValueError(f"{run.path}: layouts describe GPT stages; this run trained a "
                         f"{cfg.model.kind}")
    p = cfg.parallel
    n_units = unit_count(cfg.model)
    v = run_schedule(p, cfg.train.steps).virtual_stages
    weights = unit_weights(cfg.model)  # each unit's parameters (+1): the spread within a chunk
    bounds = stage_bounds(cfg.model, p, p.pp, v)
    times = chunk_times(run)
    missing = sorted(set(bounds) - set(times))
    if missing:
        raise ValueError(f"{run.path}: no compute events for chunk(s) {missing}; was the run "
                         f"traced (run.trace = true)?")
    costs = [0.0] * n_units
    for c, (lo, hi) in bounds.items():
        total = sum(weights[lo:hi])
        for u in range(lo, hi):
            costs[u] = times[c] * weights[u] / total
    symbols = ["E"] + ["t"] * cfg.model.n_layer + ["L"]
    return costs, symbols




def suggest_layout(run, n_chunks: int) -> str:
    """The layout that balances the run's measured per-unit costs over ``n_chunks`` stages."""
    from ..parallel.pipeline.partition import partition

    costs, symbols = unit_costs(run)
    bounds = dict(enumerate(partition(len(costs), n_chunks, "cost", weights=costs)))
    return layout_string(symbols, bounds)
