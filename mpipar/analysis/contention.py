"""Do a rank's units run slower while another rank of its node computes?

Where ranks share a node's cores, caches or memory bandwidth (a VM's vCPUs that are hyper-threads
of one core, more ranks than cores), a unit can run faster while its neighbours are idle than
while they compute. The simulator has no such term: a unit costs the same whatever runs beside
it. So in a run where this happens, the pipeline's fill and drain (one rank computing alone) are
faster than the mean costs say, and the measured bubble comes out below the prediction, even
below the uniform-cost simulation. ``contention`` measures the effect in a dump, so that a table
of predicted against measured can say which rows it marks.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .dump import Run

COMPUTE_KINDS = ("F", "B", "W", "R", "LOSS")  # what counts as a neighbour computing
MIN_UNITS = 8


def _hosts(run: Run) -> list:
    """Each rank's host (the dump's ``hostnames``, decoded by the loader); one host if absent."""
    hosts = run.attrs.get("hostnames")
    return list(hosts) if hosts and len(hosts) == run.world_size else ["?"] * run.world_size


def _samples(run: Run, steps) -> tuple[np.ndarray, np.ndarray]:
    """(share of each F/B/W unit overlapped by another same-node rank's compute, the unit's
    duration over the mean of its (rank, step, chunk, kind)); groups of one unit are left out."""
    hosts = _hosts(run)
    busy = defaultdict(list)  # (host, step) -> [(rank, start, end)] of compute
    groups = defaultdict(list)  # (rank, step, chunk, kind) -> [(start, end)]
    for r, ev in enumerate(run.events):
        e = ev[np.isin(ev["step"], steps) & np.isin(ev["kind"], COMPUTE_KINDS)]
        for x in e:
            s, a, b = int(x["step"]), float(x["start"]), float(x["end"])
            busy[(hosts[r], s)].append((r, a, b))
            if x["kind"] in ("F", "B", "W"):
                groups[(r, s, int(x["chunk"]), str(x["kind"]))].append((a, b))
    shares, ratios = [], []
    for (r, s, _, _), units in groups.items():
        d = np.array([b - a for a, b in units])
        if d.size < 2 or d.mean() <= 0:
            continue
        others = [(a2, b2) for r2, a2, b2 in busy[(hosts[r], s)] if r2 != r]
        for (a, b), ratio in zip(units, d / d.mean(), strict=True):
            if b <= a:
                continue
            over = sum(max(0.0, min(b, b2) - max(a, a2)) for a2, b2 in others)
            shares.append(min(over / (b - a), 1.0))
            ratios.append(ratio)
    return np.array(shares), np.array(ratios)


def contention(run: Run, steps) -> dict | None:
    """{"solo", "concurrent", "slowdown", "r2", "units"}: the least-squares line of each unit's
    duration (over its kind's mean on its rank in its step, as ``costmodel.jitter`` pools them)
    against the share of the unit during which another rank of its node computed. ``solo`` and
    ``concurrent`` are the line at share 0 and 1, ``slowdown`` their ratio (1: no contention),
    ``r2`` the share of the spread the line explains. None with fewer than ``MIN_UNITS`` units
    or when every unit had the same share (nothing to compare)."""
    x, y = _samples(run, steps)
    if x.size < MIN_UNITS or np.ptp(x) < 0.5:
        return None
    slope, solo = np.polyfit(x, y, 1)
    fit = solo + slope * x
    r2 = 1.0 - float(np.mean((y - fit) ** 2) / np.var(y)) if np.var(y) > 0 else 0.0
    concurrent = solo + slope
    return {"solo": float(solo), "concurrent": float(concurrent),
            "slowdown": float(concurrent / solo) if solo > 0 else float("inf"),
            "r2": r2, "units": int(x.size)}
