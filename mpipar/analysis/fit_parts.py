"""What the cost-model fit reads of one rank, worked out for every step of the rank at once.

The calibrated prediction fits each measured step of each pipeline on its own
(``predict.calibrated``): 200 steps x 4 pipelines asked for the same (rank, step) pieces, each a
dozen numpy calls on a few dozen events. Here each piece is computed once per rank for all its
steps with grouped array operations, and kept in ``Run.cache`` (with the array it came from, so
its id stays its own); a fit then only looks its steps up (``costmodel.fit``):

- ``step_parts``: overhead, dp, optimizer, sync and fixed parts (``costmodel``'s module doc);
- ``step_units``: the compute units, (step, chunk, op, mb, seconds) (``units``);
- ``step_p2p``: the durations of ``pp.send`` / ``pp.recv`` / ``pp.wait`` and the send bytes.

Each is a few arrays over the rank's steps or rows, not Python objects per step: a 1,024-rank,
1,000-step dump holds every rank's pieces at once (``analysis.stream``).
"""

from __future__ import annotations

import math

import numpy as np

from . import kinds
from .rank_steps import grouped_union, step_groups

PIPE_KINDS = ("F", "B", "W", "R", "LOSS", "pp.send", "pp.recv", "pp.wait")
UNIT_KINDS = ("F", "B", "W", "R", "LOSS")


class StreamedError(RuntimeError):
    """A piece of a streamed run (``analysis.stream``) that its pass did not work out."""


def cached(run, r: int, name, make):
    """``make(events of rank r)``, once per run and rank (``name`` tells pieces apart). A run
    loaded streamed (``analysis.stream``) holds only a residue of each rank's events: its pieces
    were worked out in the pass over the rank's events (keyed by rank), any other is an error."""
    got = run.cache.get(("rank", r, name))
    if got is not None:
        return got
    if run.cache.get("streamed"):
        raise StreamedError(f"{name!r} of rank {r} was not worked out in the streamed pass; "
                            "load the dump whole (mpipar.analysis.load)")
    ev = run.events[r]
    key = (name, id(ev))
    got = run.cache.get(key)
    if got is None or got[0] is not ev:
        got = run.cache[key] = (ev, make(ev))
    return got[1]


def _min(g, x, n, empty):
    out = np.full(n, math.inf)
    np.minimum.at(out, g, x)
    return np.where(np.isinf(out), empty, out)


def _max(g, x, n, empty):
    out = np.full(n, -math.inf)
    np.maximum.at(out, g, x)
    return np.where(np.isinf(out), empty, out)


def _sum(g, x, n):
    return np.bincount(g, weights=x, minlength=n)


def _is_pipe(kind: str) -> bool:
    return kind in PIPE_KINDS


def _dotted(kind: str) -> bool:
    return "." in kind


PART_NAMES = ("overhead", "dp", "optimizer", "sync", "step_post", "step_pre")


def step_parts(ev: np.ndarray, n_actions: int) -> dict:
    """{"steps": the rank's steps sorted, name: value per step (NaN: the step lacks what it
    needs: pipeline events, an OPT, a STEP marker), "dp_chunks": bit mask of the chunks with
    dp events per step} for names "overhead", "dp", "optimizer", "sync", "step_post",
    "step_pre" (``costmodel``'s module doc)."""
    steps, g, n = step_groups(ev)
    code = kinds.codes_of(ev)
    mark, body = code == kinds.STEP, code != kinds.STEP
    start, end = ev["start"], ev["end"]
    dur = end - start
    is_opt = code == kinds.code("OPT")
    o0 = _min(g[is_opt], start[is_opt], n, math.inf)
    o1 = _max(g[is_opt], end[is_opt], n, math.nan)
    before = body & (start < o0[g])
    pipe = before & kinds.table(_is_pipe)[code]
    p_lo = _min(g[pipe], start[pipe], n, math.nan)
    p_hi = _max(g[pipe], end[pipe], n, math.nan)
    with np.errstate(invalid="ignore"):
        inside = before & (start >= p_lo[g]) & (end <= p_hi[g])
    covered = grouped_union(g[inside], start[inside], end[inside], n)
    overhead = ((p_hi - p_lo) - covered) / max(n_actions, 1)
    is_dp = (kinds.table(kinds.axis)[code] == "dp") & body
    dp = _sum(g[is_dp], dur[is_dp], n)
    chunk = ev["chunk"][is_dp].astype(np.int64)
    mask = np.zeros(n, dtype=np.int64)
    ok = (chunk >= 0) & (chunk < 63)
    np.bitwise_or.at(mask, g[is_dp][ok], np.left_shift(1, chunk[ok]))
    with np.errstate(invalid="ignore"):
        nested = body & (start >= o0[g]) & (end <= o1[g]) & kinds.table(_dotted)[code]
        gap_dp = is_dp & (start >= p_hi[g]) & (end <= o0[g])
    coll = _sum(g[nested], dur[nested], n)
    gap = o0 - p_hi - _sum(g[gap_dp], dur[gap_dp], n)
    m_lo = _min(g[mark], start[mark], n, math.nan)
    m_hi = _max(g[mark], end[mark], n, math.nan)
    b_lo = _min(g[body], start[body], n, math.nan)
    has_opt = ~np.isnan(o1)
    with np.errstate(invalid="ignore"):
        sync = coll + np.where(np.isnan(gap), 0.0, np.maximum(gap, 0.0))
    return {"steps": steps.astype(np.int64),
            "overhead": np.where(np.isnan(p_lo), math.nan, overhead),
            "dp": dp, "dp_chunks": mask,
            "optimizer": np.where(has_opt, (o1 - o0) - coll, math.nan),
            "sync": np.where(has_opt, sync, math.nan),
            "step_post": np.where(has_opt & ~np.isnan(m_hi), m_hi - o1, math.nan),
            "step_pre": np.where(np.isnan(m_lo) | np.isnan(b_lo), math.nan, b_lo - m_lo)}


def chunks_of(mask: int) -> list[int]:
    """The chunks a ``dp_chunks`` bit mask holds."""
    return [c for c in range(63) if (int(mask) >> c) & 1]


OPS = ("F", "B", "BW", "W")  # a unit's op, by its code in ``step_units``


def step_units(ev: np.ndarray, p: int, split: dict) -> dict:
    """{"step", "chunk", "op" (code into ``OPS``), "mb", "dur"}: one row per compute unit of
    one rank (pipeline coordinate ``p``) by step, in recording order within a step: op F (+
    its LOSS), B or BW (+ its
    R; ``split`` says which, ``units._backward_ops``) and W. A LOSS or R adds to the unit of
    its (step, mb, chunk) and kind, summed in recording order when there are several."""
    code = kinds.codes_of(ev)
    f, b, w = kinds.code("F"), kinds.code("B"), kinds.code("W")
    is_unit = (code == f) | (code == b) | (code == w)
    is_extra = (code == kinds.code("LOSS")) | (code == kinds.code("R"))
    u, x = ev[is_unit], ev[is_extra]
    dur = u["end"] - u["start"]
    cu = code[is_unit]
    target = np.where(cu == f, 0, np.where(cu == b, 1, 2))
    if x.size:
        key_u = _unit_key(u, target)
        key_x = _unit_key(x, np.where(code[is_extra] == kinds.code("LOSS"), 0, 1))
        uniq, inv = np.unique(key_x, return_inverse=True)
        extra = np.bincount(inv.reshape(-1), weights=x["end"] - x["start"],
                            minlength=uniq.size)
        at = np.minimum(np.searchsorted(uniq, key_u), uniq.size - 1)
        hit = (uniq[at] == key_u) & (target < 2)
        dur = np.where(hit, dur + extra[at], dur)
    op = np.where(target == 0, 0, np.where(target == 1, 1, 3)).astype(np.int8)
    if split:
        for i in np.flatnonzero(target == 1).tolist():
            if split.get((p, int(u["mb"][i]), int(u["chunk"][i])), "B") == "BW":
                op[i] = 2
    order = np.argsort(u["step"], kind="stable")
    return {"step": u["step"][order], "chunk": u["chunk"][order],
            "op": op[order], "mb": u["mb"][order], "dur": dur[order]}


def _unit_key(e, target) -> np.ndarray:
    """One integer per (step, mb, chunk, F | B) of rows ``e`` (steps from -1, mb and chunk
    from -1, each below 2^20)."""
    s = e["step"].astype(np.int64) + 1
    mb = e["mb"].astype(np.int64) + 1
    c = e["chunk"].astype(np.int64) + 1
    return ((s << 20 | mb) << 20 | c) << 1 | target.astype(np.int64)


P2P_KINDS = ("pp.send", "pp.recv", "pp.wait")


def step_p2p(ev: np.ndarray) -> dict:
    """{"send", "recv", "wait": (steps, durations), "bytes": (steps, send payloads)} of one
    rank, each sorted by step (recording order within a step)."""
    code, out = kinds.codes_of(ev), {}
    step, dur = ev["step"], ev["end"] - ev["start"]  # the columns read, not whole rows
    for name, kind in zip(("send", "recv", "wait"), P2P_KINDS, strict=True):
        at = np.flatnonzero(code == kinds.code(kind))
        at = at[np.argsort(step[at], kind="stable")]
        out[name] = (step[at].astype(np.int32), dur[at])
        if name == "send":
            out["bytes"] = (out[name][0], ev["bytes"][at])
    return out


def rows_of(steps_sorted: np.ndarray, want) -> np.ndarray:
    """Indices into an array sorted by step of the rows of the steps ``want`` (in its order)."""
    want = np.atleast_1d(np.asarray(want, dtype=np.int64))
    lo = np.searchsorted(steps_sorted, want, "left")
    hi = np.searchsorted(steps_sorted, want, "right")
    if want.size == 1:
        return np.arange(lo[0], hi[0])
    n = hi - lo
    if not n.sum():
        return np.empty(0, dtype=np.intp)
    return np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
