"""One rank's breakdown of every measured step at once (the columns ``breakdown`` defines).

A Python loop over (rank, step) with a dozen numpy calls each cost 1-5 ms a step: minutes for a
1,024-rank, 1,000-step dump. Here a rank's events are grouped by step once and every column is
a grouped sum (``np.bincount``) or a grouped union of intervals: the intervals sorted by (step,
start) once, a running maximum of their ends, a new block where a start passes it or a step
begins, each block's end its maximum (``np.maximum.reduceat``). The running maximum is shared
by all steps, which is exact when each step's intervals end before the next step's begin, as a
training loop's steps do (``grouped_union``; else a step at a time with ``union_length``).
"""

from __future__ import annotations

import math

import numpy as np

from . import kinds

COMPUTE_KINDS = ("F", "B", "W", "R", "LOSS", "OPT")
PIPE_COMPUTE = ("F", "B", "W", "R", "LOSS")  # model compute: the bubble's complement
COMM_AXES = ("pp", "tp", "dp", "world")  # kind prefixes "pp.", "tp.", ...
# self-time precedence: an instant covered by several events goes to the first listed
SELF_ORDER = COMM_AXES + COMPUTE_KINDS + ("other",)


def union_length(starts, ends, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Total length covered by intervals [starts[i], ends[i]] clipped to [lo, hi], overlaps once."""
    s = np.clip(np.asarray(starts, dtype=float), lo, hi)
    e = np.clip(np.asarray(ends, dtype=float), lo, hi)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return 0.0
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    # running max of ends: an interval starts a new block when it begins after everything before it
    reach = np.maximum.accumulate(e)
    new_block = np.empty(s.size, dtype=bool)
    new_block[0] = True
    new_block[1:] = s[1:] > reach[:-1]
    block_id = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = np.zeros(block_start.size)
    np.maximum.at(block_end, block_id, e)
    return float(np.sum(block_end - block_start))


def category(kind: str) -> int:
    """The index of ``kind`` in ``SELF_ORDER`` (``other``: the last)."""
    axis = kind.partition(".")[0] if "." in kind else None
    if axis in COMM_AXES:
        return SELF_ORDER.index(axis)
    return SELF_ORDER.index(kind) if kind in COMPUTE_KINDS else len(SELF_ORDER) - 1


def _categories(codes: np.ndarray) -> np.ndarray:
    """Per event (its kind code, ``kinds``), its index in ``SELF_ORDER``."""
    return kinds.table(category)[codes]


def step_groups(ev: np.ndarray) -> tuple:
    """(the distinct steps of ``ev`` sorted, each event's index among them, how many)."""
    steps, g = np.unique(ev["step"], return_inverse=True)
    return steps, g.reshape(-1), steps.size


def grouped_union(g, s, e, n: int, ordered: bool = False) -> np.ndarray:
    """Per group 0..n-1, the length its intervals [s, e] cover (overlaps once; ``union_length``
    of each group). One running maximum of the ends over the intervals sorted by (group,
    start) when each group's intervals end before the next group's begin (steps one after
    another); else a group at a time. ``ordered``: the intervals come sorted by (group, start)
    and the groups are known to follow one another (``_unions``)."""
    out = np.zeros(n)
    keep = e > s
    g, s, e = g[keep], s[keep], e[keep]
    if not s.size:
        return out
    if not ordered:
        lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
        np.minimum.at(lo, g, s)
        np.maximum.at(hi, g, e)
        used = np.isfinite(lo)
        if not np.all(lo[used][1:] >= hi[used][:-1]):
            return np.array([union_length(s[g == i], e[g == i]) for i in range(n)])
        order = np.lexsort((s, g))
        g, s, e = g[order], s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = (s[1:] > reach[:-1]) | (g[1:] != g[:-1])
    at = np.flatnonzero(new)
    return out + np.bincount(g[at], weights=np.maximum.reduceat(e, at) - s[at], minlength=n)


def rank_steps(ev: np.ndarray, steps: list[int]) -> dict:
    """{column: array over ``steps``} of one rank (``breakdown``'s columns, plus ``lo``,
    ``hi``, ``pipe_lo``, ``pipe_hi``, ``pipe_compute``, ``has`` (the step has events) and
    ``marked`` (it has a STEP marker)). ``ev``: the rank's events, any order."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    n = steps_arr.size
    order = np.argsort(steps_arr)
    at = np.searchsorted(steps_arr[order], ev["step"])
    at = np.minimum(at, max(n - 1, 0))
    inside = (steps_arr[order][at] == ev["step"]) if n else np.zeros(len(ev), bool)
    code, g = kinds.codes_of(ev)[inside], order[at[inside]]
    # the columns read, not whole rows (a row carries its kind string)
    start, end = ev["start"][inside], ev["end"][inside]
    is_marker = code == kinds.STEP
    out = {"has": np.bincount(g, minlength=n) > 0,
           "marked": np.bincount(g[is_marker], minlength=n) > 0}
    lo = _group_min(g[is_marker], start[is_marker], n)
    hi = _group_max(g[is_marker], end[is_marker], n)
    in_body = ~is_marker
    body = {"start": start[in_body], "end": end[in_body]}
    gb = g[in_body]
    lo = np.where(out["marked"], lo, _group_min(gb, body["start"], n))
    hi = np.where(out["marked"], hi, _group_max(gb, body["end"], n))
    out.update(lo=lo, hi=hi, step_time=hi - lo)
    dur = body["end"] - body["start"]
    cat = _categories(code[in_body])
    # one grouped sum over (step, category): each bin adds its events in the same order as a
    # sum per category would, so the same floats
    c = len(SELF_ORDER)
    sums = np.bincount(gb * c + cat, weights=dur, minlength=n * c).reshape(n, c).T
    for k in COMPUTE_KINDS:
        out[k] = sums[SELF_ORDER.index(k)]
    for a in COMM_AXES:
        out[f"comm_{a}"] = sums[SELF_ORDER.index(a)]
    out["compute"] = sum(out[k] for k in COMPUTE_KINDS)
    out["comm"] = sum(out[f"comm_{a}"] for a in COMM_AXES)
    out["other"] = sums[-1]
    is_compute = np.isin(cat, [SELF_ORDER.index(k) for k in COMPUTE_KINDS])
    _unions(out, body, gb, cat, is_compute, lo, hi, n)
    out["idle"] = out["step_time"] - out["busy"]
    pipe = sum(out[k] for k in PIPE_COMPUTE)
    out["pipe_compute"] = pipe
    with np.errstate(invalid="ignore", divide="ignore"):
        out["bubble"] = np.where(out["step_time"] > 0, 1.0 - pipe / out["step_time"], math.nan)
    pm = np.isin(cat, [SELF_ORDER.index(k) for k in PIPE_COMPUTE])
    out["pipe_lo"] = _group_min(gb[pm], body["start"][pm], n, math.nan)
    out["pipe_hi"] = _group_max(gb[pm], body["end"][pm], n, math.nan)
    return out


def _unions(out, body, gb, cat, is_compute, lo, hi, n) -> None:
    """``busy``, ``exposed`` and the ``self_<k>`` columns: unions inside each step's window."""
    s = np.clip(body["start"], lo[gb], hi[gb])
    e = np.clip(body["end"], lo[gb], hi[gb])
    # sorted by (step, start) once for every union below, when the steps follow one another
    ordered = _follow(gb, s, e, n)
    if ordered:
        order = np.lexsort((s, gb))
        gb, s, e, cat, is_compute = gb[order], s[order], e[order], cat[order], is_compute[order]

    def of(mask):
        return grouped_union(gb[mask], s[mask], e[mask], n, ordered)

    out["busy"] = of(np.ones(len(gb), bool))
    out["exposed"] = out["busy"] - of(is_compute)
    covered, before = np.zeros(n), np.zeros(len(gb), bool)
    for i, k in enumerate(SELF_ORDER):
        before |= cat == i
        now = of(before)
        out[f"self_{k}"] = now - covered
        covered = now


def _follow(g, s, e, n) -> bool:
    """Whether each group's intervals (of positive length) end before the next group's begin."""
    keep = e > s
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(lo, g[keep], s[keep])
    np.maximum.at(hi, g[keep], e[keep])
    used = np.isfinite(lo)
    return bool(np.all(lo[used][1:] >= hi[used][:-1]))


def _sorted_bounds(g):
    """(the first index of each run of equal ``g``, its group) when ``g`` never decreases (a
    rank's events recorded step after step), else None."""
    if g.size and np.all(g[1:] >= g[:-1]):
        at = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
        return at, g[at]
    return None


def _group_min(g, x, n, empty=math.inf) -> np.ndarray:
    out = np.full(n, math.inf)
    runs = _sorted_bounds(g)
    if runs is None:
        np.minimum.at(out, g, x)
    else:  # one reduction per run: the same minimum, without ``ufunc.at``'s cost
        out[runs[1]] = np.minimum.reduceat(x, runs[0])
    return np.where(np.isinf(out), empty, out) if empty != math.inf else out


def _group_max(g, x, n, empty=-math.inf) -> np.ndarray:
    out = np.full(n, -math.inf)
    runs = _sorted_bounds(g)
    if runs is None:
        np.maximum.at(out, g, x)
    else:
        out[runs[1]] = np.maximum.reduceat(x, runs[0])
    return np.where(np.isinf(out), empty, out) if empty != -math.inf else out
