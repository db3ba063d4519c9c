"""What a Python call costs between a small model's NumPy phases: the per-action overhead's
mechanism (BENCHMARKS.md, "Eighth cuts").

The lean loop's one-rank micro-batch (``mpipar/mpi/bench/lean.py``: forward, softmax
cross-entropy, backward of the small MLP, 32 rows) runs with ``k`` calls of one small function
(a clock read and two attribute stores: what ``progress.beat`` does) made after each of its
three phases, against the same loop with none. Variants run in alternating order, ``--rounds``
times ``--reps`` micro-batches; a variant's cost is the median over the rounds of its time less
the plain loop's in the same round, per call. The same call timed in a tight loop (warm) is
printed beside it. If each call cost what it costs warm, the per-call cost would not depend on
``k``; it is the first call after a phase that costs several times more: the interpreter's code
and objects come back from a farther cache after the NumPy work. So what a framework pays
between two actions grows with the distinct functions it enters, not with their work.

    python experiments/cold_frames.py            # ~40 s
    python experiments/cold_frames.py --quick    # a smoke test (a few seconds)
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpipar.mpi.bench.lean import MLP_SIZES, Stage, cross_entropy, init_params  # noqa: E402


class _Beat:
    __slots__ = ("last", "what")


_STATE = _Beat()


def beat(what) -> None:
    """``progress.beat``'s work: one clock read, two stores."""
    _STATE.last = time.monotonic()
    _STATE.what = what


def loop(stage, xs, ts, calls):
    """One step of micro-batches, ``calls`` beats after each phase."""
    def step():
        for i, (x, t) in enumerate(zip(xs, ts)):
            out, saved = stage.forward(x)
            for _ in range(calls):
                beat(i)
            _, dy = cross_entropy(out, t, 1.0 / len(xs))
            for _ in range(calls):
                beat(i)
            stage.backward(saved, dy, need_dx=False)
            for _ in range(calls):
                beat(i)
    return step


def measure(ks, rounds, reps, rows=32, microbatches=4) -> dict:
    """{k: (us per step, extra us per step over k = 0, extra us per call)}."""
    rng = np.random.default_rng(0)
    stage = Stage(init_params(list(MLP_SIZES), 0, 0.05, np.float32), head=True)
    xs = [rng.standard_normal((rows, MLP_SIZES[0])).astype(np.float32)
          for _ in range(microbatches)]
    ts = [rng.integers(0, MLP_SIZES[-1], rows) for _ in range(microbatches)]
    variants = {k: loop(stage, xs, ts, k) for k in (0, *ks)}
    for f in variants.values():  # warm-up
        for _ in range(3):
            f()
    times = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            t0 = time.perf_counter()
            for _ in range(reps):
                variants[k]()
            times[k].append((time.perf_counter() - t0) / reps * 1e6)
    out = {}
    per_call = 3 * microbatches  # calls per step for k = 1
    for k in ks:
        extra = statistics.median(a - b for a, b in zip(times[k], times[0]))
        out[k] = (statistics.median(times[k]), extra, extra / (per_call * k))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--reps", type=int, default=4, help="steps per variant and round")
    ap.add_argument("--calls", default="1,4,16", help="calls after each phase, comma-separated")
    ap.add_argument("--quick", action="store_true", help="20 rounds: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 20
    try:
        ks = [int(k) for k in args.calls.split(",")]
    except ValueError:
        ap.error(f"--calls {args.calls!r}: give whole numbers, e.g. 1,4,16")
    if min(args.rounds, args.reps, *ks) < 1:
        ap.error("--rounds, --reps and every --calls value must be >= 1")
    res = measure(ks, args.rounds, args.reps)
    warm = min(timeit.repeat(lambda: beat(0), number=100_000, repeat=5)) / 100_000 * 1e6
    print(f"small MLP, 4 micro-batches of 32 rows, one rank; load {os.getloadavg()[0]:.2f} at "
          f"the end; medians over {args.rounds} rounds of {args.reps} steps")
    print("| calls after each phase | us per step | extra us per step | us per call |")
    print("|---|---|---|---|")
    for k, (step, extra, call) in res.items():
        print(f"| {k} | {step:,.0f} | {extra:+.1f} | {call:.2f} |")
    print(f"\nthe same call in a tight loop (warm): {warm:.2f} us")


if __name__ == "__main__":
    main()
