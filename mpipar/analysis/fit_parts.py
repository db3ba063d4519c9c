"""What the cost-model fit reads of one rank, worked out for every step of the rank at once.

The calibrated prediction fits each measured step of each pipeline on its own
(``predict.calibrated``): 200 steps x 4 pipelines asked for the same (rank, step) pieces, each a
dozen numpy calls on a few dozen events. Here each piece is computed once per rank for all its
steps with grouped array operations, and kept in ``Run.cache`` (with the array it came from, so
its id stays its own); a fit then only looks its steps up (``costmodel.fit``):

- ``step_parts``: overhead, dp, optimizer, sync and fixed parts (``costmodel``'s module doc);
- ``step_units``: the compute units, {(chunk, op): [(mb, seconds)]} (``units``);
- ``step_p2p``: the durations of ``pp.send`` / ``pp.recv`` / ``pp.wait`` and the send bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from .rank_steps import grouped_union, step_groups

PIPE_KINDS = ("F", "B", "W", "R", "LOSS", "pp.send", "pp.recv", "pp.wait")
UNIT_KINDS = ("F", "B", "W", "R", "LOSS")


def cached(run, r: int, name, make):
    """``make(events of rank r)``, once per run and rank (``name`` tells pieces apart)."""
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


def step_parts(ev: np.ndarray, n_actions: int) -> dict:
    """{step: parts} of every step of one rank: "overhead", "dp", "dp_chunks", "optimizer",
    "sync", "step_post", "step_pre" (``costmodel``'s module doc), each where the step has
    what it needs (pipeline events, an OPT, a STEP marker)."""
    steps, g, n = step_groups(ev)
    kinds = ev["kind"]
    mark, body = kinds == "STEP", kinds != "STEP"
    start, end = ev["start"], ev["end"]
    dur = end - start
    is_opt = kinds == "OPT"
    o0 = _min(g[is_opt], start[is_opt], n, math.inf)
    o1 = _max(g[is_opt], end[is_opt], n, math.nan)
    before = body & (start < o0[g])
    pipe = before & np.isin(kinds, PIPE_KINDS)
    p_lo = _min(g[pipe], start[pipe], n, math.nan)
    p_hi = _max(g[pipe], end[pipe], n, math.nan)
    with np.errstate(invalid="ignore"):
        inside = before & (start >= p_lo[g]) & (end <= p_hi[g])
    covered = grouped_union(g[inside], start[inside], end[inside], n)
    overhead = ((p_hi - p_lo) - covered) / max(n_actions, 1)
    is_dp = np.char.startswith(kinds, "dp.") & body
    dp = _sum(g[is_dp], dur[is_dp], n)
    chunks = defaultdict(set)
    for s, c in zip(g[is_dp].tolist(), ev["chunk"][is_dp].tolist(), strict=True):
        if c >= 0:
            chunks[s].add(int(c))
    with np.errstate(invalid="ignore"):
        nested = body & (start >= o0[g]) & (end <= o1[g]) & (np.char.find(kinds, ".") >= 0)
        gap_dp = is_dp & (start >= p_hi[g]) & (end <= o0[g])
    coll = _sum(g[nested], dur[nested], n)
    gap = o0 - p_hi - _sum(g[gap_dp], dur[gap_dp], n)
    m_lo = _min(g[mark], start[mark], n, math.nan)
    m_hi = _max(g[mark], end[mark], n, math.nan)
    b_lo = _min(g[body], start[body], n, math.nan)
    out = {}
    for i, s in enumerate(steps.tolist()):
        d = {}
        if not math.isnan(p_lo[i]):
            d["overhead"] = float(overhead[i])
        d["dp"] = float(dp[i])
        d["dp_chunks"] = sorted(chunks.get(i, ()))
        if not math.isnan(o1[i]):
            d["optimizer"] = float((o1[i] - o0[i]) - coll[i])
            d["sync"] = float(coll[i] + (max(gap[i], 0.0) if not math.isnan(gap[i]) else 0.0))
            if not math.isnan(m_hi[i]):
                d["step_post"] = float(m_hi[i] - o1[i])
        if not math.isnan(m_lo[i]) and not math.isnan(b_lo[i]):
            d["step_pre"] = float(b_lo[i] - m_lo[i])
        out[s] = d
    return out


def step_units(ev: np.ndarray, p: int, split: dict) -> dict:
    """{step: {(chunk, op): [(mb, seconds)]}} of one rank (pipeline coordinate ``p``): op F
    (+ its LOSS), B or BW (+ its R; ``split`` says which, ``units._backward_ops``) and W, in
    recording order."""
    e = ev[np.isin(ev["kind"], UNIT_KINDS)]
    rows = zip(e["step"].tolist(), e["kind"].tolist(), e["mb"].tolist(), e["chunk"].tolist(),
               (e["end"] - e["start"]).tolist(), strict=True)
    extra, units = defaultdict(float), []  # (step, mb, chunk, F | B) -> LOSS or R seconds
    for s, kind, mb, c, d in rows:
        if kind in ("LOSS", "R"):
            extra[(s, mb, c, "F" if kind == "LOSS" else "B")] += d
        else:
            units.append((s, kind, mb, c, d))
    out = defaultdict(lambda: defaultdict(list))
    for s, kind, mb, c, d in units:
        op = split.get((p, mb, c), kind) if kind == "B" else kind
        out[s][(c, op)].append((mb, d + extra.get((s, mb, c, kind), 0.0)))
    return {s: dict(v) for s, v in out.items()}


def step_p2p(ev: np.ndarray) -> dict:
    """{step: {"send", "recv", "wait": durations, "bytes": send payloads}} of one rank."""
    steps, g, n = step_groups(ev)
    kinds, dur = ev["kind"], ev["end"] - ev["start"]
    cols = {}
    for name, kind in (("send", "pp.send"), ("recv", "pp.recv"), ("wait", "pp.wait")):
        m = kinds == kind
        cols[name] = _split(g[m], dur[m], n)
    m = kinds == "pp.send"
    cols["bytes"] = _split(g[m], ev["bytes"][m], n)
    return {s: {k: v[i] for k, v in cols.items()} for i, s in enumerate(steps.tolist())}


def _split(g, x, n) -> list:
    """x grouped by g (0..n-1), recording order kept within a group."""
    order = np.argsort(g, kind="stable")
    return np.split(x[order], np.searchsorted(g[order], np.arange(1, n)))
