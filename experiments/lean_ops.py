"""Which operation makes the lean loop's micro-batch faster than mpipar's on wide layers: each
operation that the two write differently, switched one at a time.

The micro-batch is the lean loop's (``mpipar/mpi/bench/lean.py``: forward, softmax
cross-entropy, backward with no input gradient for the first linear), written here once with
each of these operations done either the lean loop's way or the way of mpipar's layer path
(``nn/cpu.py``'s kernels and buffer pool, ``nn/functional.py``):

- ``fwd``: the forward product into a pooled buffer (``cpu.matmul(out=cpu.empty(...))``) vs an
  allocating ``x @ W``;
- ``relu``: the ReLU forward into a new array (``np.maximum(z, 0.0)``) vs in place;
- ``dw``: the weight gradient made in a pooled scratch buffer then added vs ``g += x.T @ dy``;
- ``db``: the bias gradient as ``ones @ dy`` vs ``dy.sum(axis=0)``;
- ``dx``: the input gradient into a pooled buffer vs an allocating ``dy @ W.T``.

Variants: ``lean`` (every operation the lean way), ``layers`` (every one the layer path's way),
and ``+OP`` (the lean loop with only OP done the layer path's way; the dense fast path,
``nn/dense.py``, does every one of them that way where a product's output is above the pool's
size, as on the 1024-wide layers). All run in turn, ``--rounds`` times ``--reps`` micro-batches
each, so that a slow moment of the machine hits all; the table is the median over the rounds of
the microseconds per micro-batch, the median over the rounds of each variant's time over
``lean``'s in the same round, the minor page faults per micro-batch, and each part's time for
``lean`` and ``layers``.
One BLAS thread and one kernel thread (set before NumPy loads).

    python experiments/lean_ops.py                 # 1024-wide MLP at batch 32 (~30 s)
    python experiments/lean_ops.py --quick         # a smoke test (a few seconds)
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "MPIPAR_KERNEL_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpipar.mpi.bench.lean import cross_entropy, init_params  # noqa: E402
from mpipar.nn import cpu  # noqa: E402
from mpipar.nn import functional as F  # noqa: E402

WIDE = (784, 1024, 1024, 1024, 1024, 1024, 1024, 10)
OPS = ("fwd", "relu", "dw", "db", "dx")


PARTS = ("fwd", "bias", "relu", "loss", "mask", "dw", "db", "dx")


def micro_batch(params, grads, x, t, ours, acc):
    """One micro-batch; the operations named in ``ours`` done the layer path's way.
    ``acc[part]`` gains each part's seconds (``PARTS``; ``mask``: the ReLU's backward)."""
    clock = time.perf_counter
    saved, n = [], len(params)
    t0 = clock()
    for i, (w, b) in enumerate(params):
        if "fwd" in ours:
            z = cpu.matmul(np, x, w, cpu.empty(np, (x.shape[0], w.shape[1]), x.dtype))
        else:
            z = x @ w
        t0 = _tick(acc, "fwd", t0, clock)
        z += b
        t0 = _tick(acc, "bias", t0, clock)
        if i < n - 1:
            z = np.maximum(z, 0.0) if "relu" in ours else np.maximum(z, 0, out=z)
            t0 = _tick(acc, "relu", t0, clock)
        saved.append((x, z))
        x = z
    _, dy = cross_entropy(x, t, 0.25)
    t0 = _tick(acc, "loss", t0, clock)
    for i in reversed(range(n)):
        x, z = saved[i]
        if i < n - 1:
            dy = dy * (z > 0)
            t0 = _tick(acc, "mask", t0, clock)
        gw, gb = grads[i]
        if "dw" in ours:
            cpu.matmul(np, x.T, dy, gw, accumulate=True)
        else:
            gw += x.T @ dy
        t0 = _tick(acc, "dw", t0, clock)
        if "db" in ours:
            gb += F._ones(np, dy.shape[0], dy.dtype) @ dy
        else:
            gb += dy.sum(axis=0)
        t0 = _tick(acc, "db", t0, clock)
        if i > 0:
            w = params[i][0]
            if "dx" in ours:
                dy = cpu.matmul(np, dy, w.T, cpu.empty(np, (dy.shape[0], w.shape[0]), dy.dtype))
            else:
                dy = dy @ w.T
            t0 = _tick(acc, "dx", t0, clock)


def _tick(acc, part, t0, clock):
    t1 = clock()
    acc[part] += t1 - t0
    return t1


def measure(sizes, rows, rounds, reps):
    """{variant: (median us per micro-batch, median per-round ratio to lean, page faults per
    micro-batch, {part: median us per micro-batch})}."""
    params = init_params(sizes, 0, 0.05, np.float32)
    grads = [(np.zeros_like(w), np.zeros_like(b)) for w, b in params]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, sizes[0])).astype(np.float32)
    t = rng.integers(0, sizes[-1], rows)
    variants = {"lean": (), "layers": OPS, **{f"+{op}": (op,) for op in OPS}}
    scratch = dict.fromkeys(PARTS, 0.0)
    for ours in variants.values():  # warm-up: the pool, malloc's thresholds, BLAS
        for _ in range(3):
            micro_batch(params, grads, x, t, ours, scratch)
    times, faults = {k: [] for k in variants}, dict.fromkeys(variants, 0)
    parts = {k: {p: [] for p in PARTS} for k in variants}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in names:
            acc = dict.fromkeys(PARTS, 0.0)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(reps):
                micro_batch(params, grads, x, t, variants[name], acc)
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            for p in PARTS:
                parts[name][p].append(acc[p] / reps * 1e6)
    # each variant against the lean one timed in the same round: a slow moment hits both
    return {k: (statistics.median(v), statistics.median(a / b for a, b in zip(v, times["lean"])),
                faults[k] / (rounds * reps),
                {p: statistics.median(u) for p, u in parts[k].items()})
            for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10, help="micro-batches per variant and round")
    ap.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--small", action="store_true", help="the small MLP instead")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 2: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 3, 2
    if min(args.rounds, args.reps, args.rows) < 1:
        ap.error("--rounds, --reps and --rows must be >= 1")
    sizes = (784, 128, 127, 126, 125, 124, 123, 10) if args.small else WIDE
    m = measure(sizes, args.rows, args.rounds, args.reps)
    load = os.getloadavg()[0]
    print(f"MLP {'-'.join(map(str, sizes))}, {args.rows} rows, load {load:.2f} at the end; "
          f"us per micro-batch, medians over {args.rounds} rounds")
    print("| variant | us | / lean (median of per-round ratios) | page faults per micro-batch |")
    print("|---|---|---|---|")
    for k, (us, ratio, faults, _) in m.items():
        print(f"| {k} | {us:.1f} | {ratio:.3f} | {faults:.1f} |")
    print("\nus per micro-batch by part, medians over the rounds")
    print("| part | lean | layers | layers - lean |\n|---|---|---|---|")
    lean, ours = m["lean"][3], m["layers"][3]
    for p in PARTS:
        print(f"| {p} | {lean[p]:.1f} | {ours[p]:.1f} | {ours[p] - lean[p]:+.1f} |")


if __name__ == "__main__":
    main()
