"""The compute units of a dump, per rank and step, and the cost model's ``per_unit`` costs and
jitter fitted from them (``unit_costs``, ``jitter``; ``mpipar.analysis.costmodel``).

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


def _mean(values) -> float:
    """``np.mean``'s value of a list: numpy sums fewer than 8 numbers in order, as ``sum``."""
    return sum(values) / len(values) if len(values) < 8 else float(np.mean(values))


def _groups(u: dict, by: tuple):
    """(group of each unit, number of groups, each group's first unit) by the columns ``by``,
    groups numbered in the order they are first seen."""
    key = np.zeros(u["dur"].size, dtype=np.int64)
    for name in by:
        key = key << 21 | (u[name].astype(np.int64) + 1)
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    seen = np.argsort(first, kind="stable")
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[seen] = np.arange(uniq.size)
    return rank[inv.reshape(-1)], uniq.size, first[seen]


def _group_means(dur, g, n) -> np.ndarray:
    """``_mean`` of each group's durations (in their order): a sum in order below 8 values
    (``np.bincount`` adds in order, as ``sum``), else ``np.mean`` of the group."""
    count = np.bincount(g, minlength=n)
    mean = np.bincount(g, weights=dur, minlength=n) / np.maximum(count, 1)
    for i in np.flatnonzero(count >= 8).tolist():
        mean[i] = float(np.mean(dur[g == i]))
    return mean, count


def unit_costs(run: Run, steps, schedule=None) -> dict:
    """{(p, chunk, op): mean seconds} for ops F, B, BW, W (see the module doc): the mean over a
    rank's events, then over the ranks that share p. Without both kinds of backward on a chunk
    (``_backward_ops``), B and BW are the one measured B (+ R)."""
    per_rank = defaultdict(list)
    for r in ranks_with_events(run):
        u = selected_units(run, r, steps, schedule)
        if not u["dur"].size:
            continue
        g, n, first = _groups(u, ("chunk", "op"))
        p = int(run.coords[r, 1])
        for i in range(n):
            durs = u["dur"][g == i]
            per_rank[(p, int(u["chunk"][first[i]]), OPS[int(u["op"][first[i]])])].append(
                _mean(durs.tolist()) if durs.size < 8 else float(np.mean(durs)))
    out = {k: _mean(v) for k, v in per_rank.items()}
    for (p, c, op), val in list(out.items()):
        if op == "B":
            out.setdefault((p, c, "BW"), val)
        elif op == "BW":
            out.setdefault((p, c, "B"), val)
    return out


JITTER_POINTS = 128  # quantiles kept of the pooled duration ratios


def jitter(run: Run, steps, schedule=None) -> tuple:
    """The spread of one unit's duration around its kind's mean, as ``JITTER_POINTS`` quantiles
    of d / mean(d) pooled over every (rank, step, chunk, op) with two or more units (mean 1).

    Why: a pipeline's step is a max-plus function of its units' durations (a receive waits for
    the later of its own rank and its sender), so the mean makespan is more than the makespan of
    mean durations, by more the more micro-batches meet; a model on mean costs under-counts the
    waits that a slow unit causes (ZB-V m = 8: 2 points). The ratios are within one step, as
    each step is predicted from its own means. () when no kind repeats (m = 1)."""
    ratios = []
    for r in ranks_with_events(run):
        u = selected_units(run, r, steps, schedule)
        if not u["dur"].size:
            continue
        g, n, _ = _groups(u, ("step", "chunk", "op"))
        mean, count = _group_means(u["dur"], g, n)
        keep = (count[g] > 1) & (mean[g] > 0)
        ratios.append(u["dur"][keep] / mean[g][keep])
    ratios = np.concatenate(ratios) if ratios else np.empty(0)
    if not ratios.size:
        return ()
    q = np.quantile(ratios, (np.arange(JITTER_POINTS) + 0.5) / JITTER_POINTS,
                    method="inverted_cdf")  # measured ratios, none made up between them
    return tuple(float(x) for x in q / q.mean())
