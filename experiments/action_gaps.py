"""Where a dump's per-action overhead lies: the time inside each rank's pipeline span that no
event covers (what ``mpipar analyze`` fits as ``overhead``, analysis/costmodel.py), split by the
kinds of the events on either side of each gap.

    python experiments/action_gaps.py RUN_DIR/trace.h5 [--skip 5] [--cache-probe]

Prints, per rank, the uncovered microseconds per step and, for each (event before -> event
after) pair, their sum per step, count per step and median gap; then the share of the
uncovered time that follows a compute event (F, B, W, R, LOSS).

``--cache-probe`` also times one fixed piece of Python bookkeeping (20 rounds of the dict and
list operations an action does between its events) with the interpreter's data in cache, and
right after a kernel that sweeps the caches (a 512 x 1024 x 1024 float32 matmul, ~3 ms on one
core, the size of a tiny GPT unit's backward): the ratio is how much slower the same executor
Python runs between a compute action and the next event than it would with warm caches.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from mpipar.analysis.costmodel import PIPE_KINDS
from mpipar.analysis.dump import load
from mpipar.analysis.index import events_in, ranks_with_events


def pipeline_span(e):
    """The events of one rank's step from its first to its last pipeline event, before OPT
    (the span ``costmodel`` fits the overhead over), sorted by start."""
    e = np.sort(e[e["kind"] != "STEP"], order="start")
    opt = e[e["kind"] == "OPT"]
    e = e[e["start"] < (opt["start"].min() if opt.size else np.inf)]
    pipe = e[np.isin(e["kind"], PIPE_KINDS)]
    if not pipe.size:
        return e[:0]
    return e[(e["start"] >= pipe["start"].min()) & (e["end"] <= pipe["end"].max())]


def gaps(e) -> list:
    """[(kind before, kind after, seconds)] of the uncovered stretches of ``e`` (sorted)."""
    out, covered, prev = [], (e["start"][0] if e.size else 0.0), "start"
    for ev in e:
        if ev["start"] > covered:
            out.append((prev, str(ev["kind"]), float(ev["start"] - covered)))
        if ev["end"] > covered:
            covered, prev = ev["end"], str(ev["kind"])
    return out


COMPUTE = ("F", "B", "W", "R", "LOSS")


def _bookkeeping(d, keys, log):
    """One action's worth of executor bookkeeping: dict stores and pops, a list append."""
    for k in keys:
        d[k] = k
        d[(k, 1)] = k
        log.append(k)
        d.pop((k, 1))
        d.pop(k)
    log.clear()


def cache_probe(rounds=300) -> tuple[float, float]:
    """(microseconds of ``_bookkeeping`` with warm caches, right after a ~3 ms matmul)."""
    import time

    a = np.ones((512, 1024), np.float32)
    b = np.ones((1024, 1024), np.float32)
    d, keys, log = {}, list(range(20)), []
    warm, cold = [], []
    for _ in range(rounds):
        _bookkeeping(d, keys, log)
        t = time.perf_counter()
        _bookkeeping(d, keys, log)
        warm.append(time.perf_counter() - t)
        a @ b
        t = time.perf_counter()
        _bookkeeping(d, keys, log)
        cold.append(time.perf_counter() - t)
    return float(np.median(warm)) * 1e6, float(np.median(cold)) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(prog="experiments/action_gaps.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("dump", help="RUN_DIR/trace.h5")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    p.add_argument("--cache-probe", action="store_true",
                   help="time the same bookkeeping with warm caches and after a 3 ms kernel")
    args = p.parse_args(argv)
    run = load(args.dump)
    steps = run.steps()[args.skip:]
    if not steps:
        raise SystemExit(f"{args.dump}: no step after the first {args.skip} (lower --skip)")
    for r in ranks_with_events(run):
        by = defaultdict(list)
        for s in steps:
            for before, after, g in gaps(pipeline_span(events_in(run, r, s))):
                by[(before, after)].append(g)
        n = len(steps)
        total = sum(sum(v) for v in by.values())
        print(f"rank {r}: {total / n * 1e6:.0f} us per step uncovered ({n} steps)")
        for (before, after), v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {before:>10} -> {after:<10} {sum(v) / n * 1e6:8.1f} us/step "
                  f"{len(v) / n:5.1f}/step  median {np.median(v) * 1e6:6.1f} us")
        after_compute = sum(sum(v) for (before, _), v in by.items() if before in COMPUTE)
        print(f"  after a compute event: {after_compute / n * 1e6:.0f} us/step "
              f"({after_compute / max(total, 1e-12):.0%} of the uncovered time)")
    if args.cache_probe:
        warm, cold = cache_probe()
        print(f"cache probe: the same bookkeeping {warm:.1f} us warm, {cold:.1f} us right after "
              f"a 3 ms matmul ({cold / warm:.1f}x)")


if __name__ == "__main__":
    main()
