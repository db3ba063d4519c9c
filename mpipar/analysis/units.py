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
from .fit_parts import OPS, UNIT_KINDS, cached, rows_of, step_units  # noqa: F401 (UNIT_KINDS re-exported)
from .index import ranks_with_events

_SPLITS: dict = {}  # id(schedule) -> (schedule, _backward_ops of it): one walk per schedule


def _backward_ops(schedule) -> dict:
    """``backward_ops`` of ``schedule``, worked out once per schedule object."""
    got = _SPLITS.get(id(schedule))
    if got is None or got[0] is not schedule:
        if len(_SPLITS) > 64:
            _SPLITS.clear()
        got = _SPLITS[id(schedule)] = (schedule, backward_ops(schedule))
    return got[1]


def backward_ops(schedule) -> dict:
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


def rank_units(run: Run, r: int, schedule=None) -> dict:
    """``fit_parts.step_units`` of world rank r (cached once per run)."""
    split = _backward_ops(schedule)
    key = tuple(sorted(split.items()))
    p = int(run.coords[r, 1])
    return cached(run, r, ("units", p, key), lambda ev: step_units(ev, p, split))


def selected_units(run: Run, r: int, steps, schedule=None) -> dict:
    """The units of rank r in ``steps``, ordered by step (recording order within a step), as
    ``step_units``' columns."""
    u = rank_units(run, r, schedule)
    want = np.unique(np.atleast_1d(np.asarray(steps, dtype=np.int64)))
    if want.size and u["step"].size and want[0] <= u["step"][0] and want[-1] >= u["step"][-1] \
            and np.isin(u["step"], want).all():  # every step of the rank (the whole-run fit)
        return u
    sel = rows_of(u["step"], want)
    return {k: v[sel] for k, v in u.items()}


def _unit_durations(run: Run, steps, schedule=None) -> dict:
    """{(world rank, step, chunk, op): [(mb, seconds)]} of the compute units, op F (+ its LOSS),
    B or BW (+ its R, the recomputation run right before it) and W. Each rank's units are
    worked out at once, once per run (``fit_parts.step_units``, cached)."""
    out = {}
    for r in ranks_with_events(run):
        u = selected_units(run, r, steps, schedule)
        for s, c, op, mb, d in zip(u["step"].tolist(), u["chunk"].tolist(), u["op"].tolist(),
                                   u["mb"].tolist(), u["dur"].tolist(), strict=True):
            out.setdefault((r, s, c, OPS[op]), []).append((mb, d))
    return out
