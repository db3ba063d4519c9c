"""Experiment: is the unit timing's drift the measurement or the machine?

``mpipar plan measure`` minutes apart gave the reference GPT block's forward (``[units]
ref_block_f_us``) between 1,089 and 1,421 us on a quiet machine. Its estimate is the median,
over the repeats of a ``CHAIN``-block chain run for a 0.4 s budget, of each repeat's mean per
micro-batch (``plan.unit_bench._chain``; the first repeat, which allocates, left out). This
script takes that same estimate ``--times`` times (default 20) in one process, spread over
``--minutes`` (default 2), and then once in each of ``--processes`` fresh processes (default 5),
and prints, per estimator, the spread ((max - min) / median) over the takes:

- ``median``: the spec's estimate (median over repeats 1..);
- ``min``: the fastest repeat;
- ``warm3``: the median over repeats 3.. (a longer warm-up);
- ``first``: the first repeat alone (allocation and cold caches).

If the in-process medians spread by much less than the 13 % between ``plan measure`` runs,
the estimator is not the cause: the drift is between processes or over time (the machine),
which the spec samples beside the runs (``plan.resample``) answer. If they spread as much,
a more robust estimator (the one whose spread is least here) is the fix.
Run: ``python experiments/plan_here_drift.py [--out DIR]`` (about 3 minutes alone; one BLAS
thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

for _k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_k] = "1"  # a rank's share, as plan measure times it; before NumPy loads BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's mpipar
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "plan_here_drift"
COLUMNS = ["take", "where", "at_s", "median_us", "min_us", "warm3_us", "first_us", "repeats"]


def take() -> dict:
    """One estimate of the reference block's forward (us), each estimator (module doc)."""
    from mpipar.plan.unit_bench import REF, gpt_units

    raw: list = []
    gpt_units(*REF["gpt"], 0.4, raw=raw)
    # per repeat: the blocks' (units 1..CHAIN) mean forward per micro-batch
    f = np.array([float(np.mean(r[1:-1, 0])) for r in raw]) * 1e6
    return {"median_us": float(np.median(f[1:])), "min_us": float(f[1:].min()),
            "warm3_us": float(np.median(f[3:])) if len(f) > 4 else None,  # too few repeats
            "first_us": float(f[0]), "repeats": len(f)}


def spread(xs) -> float:
    xs = [x for x in xs if x is not None]
    return 100 * (max(xs) - min(xs)) / float(np.median(xs)) if len(xs) > 1 else None


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(take()))
        return 0
    p = common.parser(NAME, __doc__)
    p.add_argument("--times", type=int, default=20, help="takes in one process (default 20)")
    p.add_argument("--minutes", type=float, default=2.0,
                   help="over how long the in-process takes spread (default 2)")
    p.add_argument("--processes", type=int, default=5,
                   help="takes in fresh processes after (default 5)")
    args = p.parse_args()
    if args.times < 2 or args.minutes < 0 or args.processes < 0:
        print("plan_here_drift: give --times >= 2, --minutes >= 0, --processes >= 0",
              file=sys.stderr)
        return 2
    out = common.out_dir(args, NAME)
    rows, t0 = [], time.perf_counter()
    gap = 60 * args.minutes / args.times
    for i in range(args.times):
        start = time.perf_counter()
        rows.append({"take": i, "where": "one process", "at_s": start - t0, **take()})
        print(f"take {i}: median {rows[-1]['median_us']:.0f} us, min {rows[-1]['min_us']:.0f}",
              flush=True)
        time.sleep(max(gap - (time.perf_counter() - start), 0.0))
    for i in range(args.processes):
        at = time.perf_counter() - t0
        got = subprocess.run([sys.executable, __file__, "--one"], capture_output=True,
                             text=True, timeout=args.timeout, check=True)
        rows.append({"take": i, "where": "fresh process", "at_s": at,
                     **json.loads(got.stdout.strip().splitlines()[-1])})
    meta = {"seconds": time.perf_counter() - t0, "machine": common.machine_note()}
    for where in ("one process", "fresh process"):
        got = [r for r in rows if r["where"] == where]
        if len(got) > 1:
            meta[where] = {k: spread([r[k] for r in got])
                           for k in ("median_us", "min_us", "warm3_us", "first_us")}
            print(f"{where} ({len(got)} takes), spread (max - min) / median: " + ", ".join(
                f"{k[:-3]} {v:.1f} %" for k, v in meta[where].items() if v is not None))
    common.write_results(out, NAME, rows, COLUMNS, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
