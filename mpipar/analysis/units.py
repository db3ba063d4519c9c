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
from .fit_parts import UNIT_KINDS, cached, step_units  # noqa: F401 (UNIT_KINDS re-exported)
from .index import ranks_with_events


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
    B or BW (+ its R, the recomputation run right before it) and W. Each rank's steps are
    worked out at once, once per run (``fit_parts.step_units``, cached): the fit of every
    replica and step, and the jitter, ask for the same ones."""
    split = _backward_ops(schedule)
    key = tuple(sorted(split.items()))
    out = {}
    for r in ranks_with_events(run):
        p = int(run.coords[r, 1])
        got = cached(run, r, ("units", p, key), lambda ev, p=p: step_units(ev, p, split))
        for s in sorted({int(x) for x in np.atleast_1d(steps)}):
            for (c, op), units in got.get(s, {}).items():
                out[(r, s, c, op)] = list(units)
    return out
