"""Where a dump's per-action overhead lies: the time inside each rank's pipeline span that no
event covers (what ``mpipar analyze`` fits as ``overhead``, analysis/costmodel.py), split by the
kinds of the events on either side of each gap.

    python experiments/action_gaps.py RUN_DIR/trace.h5 [--skip 5]

Prints, per rank, the uncovered microseconds per step and, for each (event before -> event
after) pair, their sum per step, count per step and median gap.
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="experiments/action_gaps.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("dump", help="RUN_DIR/trace.h5")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
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


if __name__ == "__main__":
    main()
