"""Achieved bandwidth per collective kind (``tp.allreduce``, ``dp.reduce_scatter``, ...) in a run.

From the trace events of the measured steps, per kind: how many, bytes, time, algorithm bandwidth
(bytes / time, nccl-tests' sizes: the buffer for all-reduce, the whole input for reduce-scatter,
the whole output for all-gather, i.e. the recorded per-rank bytes times the group size) and bus
bandwidth (nccl-tests: algbw * 2 (n-1)/n for all-reduce, * (n-1)/n for reduce-scatter and
all-gather, * 1 for broadcast), whose ceiling is the link's bandwidth whatever the group size.

A non-blocking all-reduce or reduce-scatter (data-parallel buckets) records its post as
``<axis>.allreduce`` / ``<axis>.reduce_scatter`` and its completion as ``<axis>.wait`` with the
same bytes and no peer; the two are paired in order (per axis and size) and the collective spans
post to completion. That span includes the compute it overlapped, so its
bandwidth is a lower bound (marked ``>=``).
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

from . import kinds
from .dump import Run, load
from .index import events_in

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
NONBLOCKING = ("allreduce", "reduce_scatter")  # may be posts, completed by a later wait


def bus_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    return 1.0 if op == "broadcast" else (n - 1) / n


def _group_size(run: Run, axis: str) -> int:
    return int(run.world_size if axis == "world" else run.grid.get(axis, 1))


def _looked_at(kind: str) -> int:
    """1: a collective (``OPS``), 2: a wait, 0: neither (``_collective_rows``)."""
    op = kind.partition(".")[2]
    return 1 if op in OPS else 2 if op == "wait" else 0


def _collective_rows(ev) -> tuple:
    """(the rows ``_rank_spans`` looks at: collectives and waits, picked by numpy so that its
    loop runs over them only; their kind codes)."""
    code = kinds.codes_of(ev)
    what = kinds.table(_looked_at)[code]
    keep = (what == 1) | ((what == 2) & (ev["peer"] < 0))
    return ev[keep], code[keep]


def _rank_spans(run, r, steps):
    """[(kind, op, bytes, seconds, overlapped, count)] of one rank's collectives in ``steps``:
    the posts of a non-blocking kind that a wait of its (axis, bytes) may complete, one by one
    (paired in order); every other collective summed as one row per (kind, bytes)."""
    ev, code = _collective_rows(events_in(run, r, steps))
    names = kinds.names()
    axis, op = kinds.table(kinds.axis)[code], kinds.table(kinds.op)[code]
    waits = op == "wait"
    paired = np.zeros(len(ev), dtype=bool)  # rows of an (axis, bytes) that has waits
    for ax, nb in {(str(x), int(b)) for x, b in zip(axis[waits], ev["bytes"][waits])}:
        paired |= (axis == ax) & (ev["bytes"] == nb)
    out = _paired_spans(ev[paired], [names[c] for c in code[paired].tolist()])
    rest = ~paired & ~waits
    if rest.any():
        # one row per (kind, bytes), in the order of the kinds' names then bytes
        uniq, inv = np.unique(code[rest], return_inverse=True)
        by_name = np.argsort([names[c] for c in uniq.tolist()], kind="stable")
        uniq, inv = uniq[by_name], np.argsort(by_name)[inv.reshape(-1)]
        nbytes = ev["bytes"][rest]
        keys, at = np.unique(np.stack([inv, nbytes]), axis=1, return_inverse=True)
        at = at.reshape(-1)
        count = np.bincount(at)
        secs = np.bincount(at, weights=ev["end"][rest] - ev["start"][rest])
        for j, (k, nb) in enumerate(keys.T.tolist()):
            kind = names[int(uniq[k])]
            out.append((kind, kind.partition(".")[2], int(nb) * int(count[j]), float(secs[j]),
                        False, int(count[j])))
    return out


def rank_totals(run, r, steps) -> list:
    """``_rank_spans`` of rank r summed per kind: [(kind, op, bytes, seconds, overlapped,
    count)] (``bandwidth`` sums them over ranks; once per run and steps: a 1,000-step rank has
    thousands of spans)."""
    from .fit_parts import cached

    def make(_):
        acc = {}
        for kind, op, nbytes, seconds, overlapped, count in _rank_spans(run, r, steps):
            a = acc.setdefault(kind, [kind, op, 0, 0.0, False, 0])
            a[2] += nbytes
            a[3] += seconds
            a[4] |= overlapped
            a[5] += count
        return [tuple(a) for a in acc.values()]

    return cached(run, r, ("bandwidth", tuple(int(s) for s in steps)), make)


def _paired_spans(ev, names) -> list:
    """Posts paired in order with the waits that complete them (per axis and size)."""
    queued = defaultdict(deque)  # (axis, bytes) -> posts not yet paired with a wait
    spans = []  # [kind, op, bytes, start, end, overlapped]
    for e, kind in zip(ev, names):
        axis, _, op = kind.partition(".")
        nbytes = int(e["bytes"])
        if op in OPS:
            spans.append([kind, op, nbytes, float(e["start"]), float(e["end"]), False])
            if op in NONBLOCKING:
                queued[(axis, nbytes)].append(spans[-1])
        elif op == "wait" and int(e["peer"]) < 0 and queued[(axis, nbytes)]:
            span = queued[(axis, nbytes)].popleft()
            span[4], span[5] = float(e["end"]), True
    return [(k, op, b, end - start, o, 1) for k, op, b, start, end, o in spans]


def bandwidth(run: Run | str, steps=None) -> list[dict]:
    """One row per collective kind: count, bytes, seconds, algbw, busbw (GB/s), overlapped."""
    if not isinstance(run, Run):
        run = load(run)
    steps = run.steps() if steps is None else list(steps)
    rows = {}
    for r in range(len(run.events)):
        for kind, op, nbytes, seconds, overlapped, count in rank_totals(run, r, steps):
            n = _group_size(run, kind.partition(".")[0])
            size = nbytes * n if op == "allgather" else nbytes
            r = rows.setdefault(kind, {"kind": kind, "op": op, "group": n, "count": 0,
                                       "bytes": 0, "seconds": 0.0, "overlapped": False})
            r["count"] += count
            r["bytes"] += size
            r["seconds"] += seconds
            r["overlapped"] |= overlapped
    out = []
    for kind in sorted(rows):
        r = rows[kind]
        algbw = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else float("nan")
        r["algbw"], r["busbw"] = algbw, algbw * bus_factor(r["op"], r["group"])
        out.append(r)
    return out


def bandwidth_text(run, steps=None, rows=None) -> str:
    """The table ``mpipar analyze`` prints under a run (empty when the run has no collectives).
    ``run``: a Run or a dump's path; ``rows``: ``bandwidth``'s, when already computed."""
    rows = bandwidth(run, steps) if rows is None else rows
    rows = [r for r in rows if r["group"] > 1]
    if not rows:
        return ""
    lines = ["achieved collective bandwidth (all ranks, measured steps; GB/s, nccl-tests sizes; "
             ">= : non-blocking, spans post to completion):",
             f"  {'kind':<20} {'ranks':>5} {'count':>6} {'MB':>10} {'ms':>9} {'algbw':>9} "
             f"{'busbw':>9}"]
    for r in rows:
        mark = ">=" if r["overlapped"] else "  "
        lines.append(f"  {r['kind']:<20} {r['group']:>5} {r['count']:>6} "
                     f"{r['bytes'] / 1e6:>10.3f} {r['seconds'] * 1e3:>9.3f} "
                     f"{mark}{r['algbw']:>7.3f} {mark}{r['busbw']:>7.3f}")
    return "\n".join(lines)
