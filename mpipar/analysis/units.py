"""The compute units of a dump, per rank and step: what the cost model's ``per_unit`` costs and
its jitter are fitted from (``mpipar.analysis.costmodel``).

A unit is F (+ its LOSS on the last chunk), B or BW (+ its R, the recomputation run right before
it) or W. Each rank's step is worked out once per run and cached in ``Run.cache``: the fit of
every replica and step, and the jitter, ask for the same ones.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .dump import Run
from .index import events_in, ranks_with_events

UNIT_KINDS = ("F", "B", "W", "R", "LOSS")


def _backward_ops(schedule) -> dict:
    """{(p, mb, chunk): "B" | "BW"} where one rank runs both kinds of backward on one chunk
    (DualPipeV: the last micro-batches' backwards are whole, the others split off their W). A
    dump records either as one ``B`` event; a mean over both is right for neither."""
    out = {}
    if schedule is None:
        return out
    for p, acts in enumerate(schedule.ranks):
        kinds = defaultdict(set)
        for a in acts:
            if a.op in ("B", "BW"):
                kinds[a.chunk].add(a.op)
        out.update({(p, a.mb, a.chunk): a.op for a in acts
                    if a.op in ("B", "BW") and len(kinds[a.chunk]) == 2})
    return out


def _unit_durations(run: Run, steps, schedule=None) -> dict:
    """{(world rank, step, chunk, op): [(mb, seconds)]} of the compute units, op F (+ its LOSS),
    B or BW (+ its R, the recomputation run right before it) and W. Each rank's step is worked
    out once per run (``_rank_step_units``, cached): the fit of every replica and step, and the
    jitter, ask for the same ones."""
    split = _backward_ops(schedule)
    key = tuple(sorted(split.items()))
    out = {}
    for r in ranks_with_events(run):
        p = int(run.coords[r, 1])
        for s in sorted({int(x) for x in np.atleast_1d(steps)}):
            for (c, op), got in _rank_step_units(run, r, s, p, split, key).items():
                out[(r, s, c, op)] = list(got)
    return out


def _rank_step_units(run: Run, r: int, s: int, p: int, split: dict, key: tuple) -> dict:
    """{(chunk, op): [(mb, seconds)]} of rank r's units in step s (``_unit_durations``)."""
    ev = run.events[r]
    cache_key = ("units", id(ev), s, p, key)
    got = run.cache.get(cache_key)
    if got is not None and got[0] is ev:
        return got[1]
    e = events_in(run, r, s)
    e = e[np.isin(e["kind"], UNIT_KINDS)]
    extra = defaultdict(float)  # (mb, chunk, F | B) -> LOSS or R seconds
    for x in e[np.isin(e["kind"], ("LOSS", "R"))]:
        base = "F" if x["kind"] == "LOSS" else "B"
        extra[(int(x["mb"]), int(x["chunk"]), base)] += float(x["end"] - x["start"])
    out = defaultdict(list)
    for x in e[np.isin(e["kind"], ("F", "B", "W"))]:
        mb, c, kind = int(x["mb"]), int(x["chunk"]), str(x["kind"])
        op = split.get((p, mb, c), kind) if kind == "B" else kind
        out[(c, op)].append((mb, float(x["end"] - x["start"]) + extra.get((mb, c, kind), 0.0)))
    run.cache[cache_key] = (ev, dict(out))  # the array kept with it: its id stays its own
    return run.cache[cache_key][1]
