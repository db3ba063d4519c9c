"""One micro-batch of a small MLP in one process: the layer path, the dense fast path and the
lean loop's inline NumPy, side by side.

Forward, loss and backward of one micro-batch through a whole model's chunk (the model's first
chunk: no input gradient for the first linear), each variant on the same weights and inputs:

- ``layers``: the pipeline's ``Chunk`` with every layer's own passes (``set_dense(False)``);
- ``dense``: the same chunk on the dense fast path (``mpipar/nn/dense.py``), the same kernels;
- ``lean``: the lean loop's ``Stage`` and ``cross_entropy`` (``mpipar/mpi/bench/lean.py``):
  operators and NumPy calls written inline, no layer objects.

The three run in turn, ``--rounds`` times ``--reps`` micro-batches each, so that a slow moment
of the machine hits all three; the table is the median over the rounds of the microseconds per
micro-batch. One BLAS thread and one kernel thread (set before NumPy loads).

    python experiments/lean_chunk.py            # small MLP at batch 32 and 8, 1024-wide at 32
    python experiments/lean_chunk.py --quick    # 3 rounds: a smoke test (a few seconds)

Measured numbers go to BENCHMARKS.md ("The dense fast path") with the load they ran under.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "MPIPAR_KERNEL_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpipar.backend import Backend  # noqa: E402
from mpipar.models.mlp import build_mlp  # noqa: E402
from mpipar.mpi.bench.lean import Stage, cross_entropy  # noqa: E402
from mpipar.parallel.pipeline.executor import build_chunks  # noqa: E402

SMALL = (784, 128, 127, 126, 125, 124, 123, 10)
WIDE = (784, 1024, 1024, 1024, 1024, 1024, 1024, 10)
# name, sizes, rows per micro-batch, micro-batches per round (fewer for the wide layers)
CASES = (("small MLP, batch 32", SMALL, 32, 200), ("small MLP, batch 8", SMALL, 8, 400),
         ("1024-wide MLP, batch 32", WIDE, 32, 20))


def make(sizes, rows, seed=0):
    """(chunk, loss, lean stage, inputs, targets) on the same float32 weights."""
    mcfg = types.SimpleNamespace(sizes=list(sizes), activation="relu", task="classification",
                                 init_std=0.1, kind="mlp")
    model = build_mlp(mcfg, Backend("cpu", "float32"), seed=seed)
    chunk = build_chunks(model, {0: (0, len(model.units))}, 0, 1)[0]
    params = [(u.layers[0].w.data.copy(), u.layers[0].b.data.copy()) for u in model.units]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, sizes[0])).astype(np.float32)
    t = rng.integers(0, sizes[-1], rows)
    return chunk, model.loss, Stage(params, head=True), x, t


def variants(chunk, loss, stage, x, t):
    scale = 0.25  # the loss of one of 4 micro-batches

    def mpipar_step():
        y = chunk.forward(x, 0)
        loss.forward(y, t, 0, scale)
        chunk.backward_first(loss.backward(0), 0)

    def lean_step():
        y, saved = stage.forward(x)
        _, dy = cross_entropy(y, t, scale)
        stage.backward(saved, dy, need_dx=False)

    return {"layers": (lambda: chunk.set_dense(False), mpipar_step),
            "dense": (lambda: chunk.set_dense(True), mpipar_step),
            "lean": (lambda: None, lean_step)}


def measure(case, rounds, reps_scale):
    name, sizes, rows, reps = case
    reps = max(1, int(reps * reps_scale))
    chunk, loss, stage, x, t = make(sizes, rows)
    runs = variants(chunk, loss, stage, x, t)
    times = {k: [] for k in runs}
    for setup, step in runs.values():  # warm-up: caches, the buffer pool, BLAS
        setup()
        for _ in range(3):
            step()
    for _ in range(rounds):
        for k, (setup, step) in runs.items():
            setup()
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            times[k].append((time.perf_counter() - t0) / reps * 1e6)
    if chunk.set_dense(True) is not True:
        raise SystemExit(f"{name}: the chunk does not take the dense path")
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="alternations (default 15)")
    ap.add_argument("--reps-scale", type=float, default=1.0,
                    help="scale the micro-batches per round (default 1)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of a tenth: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.reps_scale = 3, 0.1
    if args.rounds < 1 or args.reps_scale <= 0:
        ap.error("--rounds must be >= 1 and --reps-scale > 0")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load {load:.2f} at the start; {args.rounds} rounds; us per micro-batch "
          f"(forward + loss + backward, first chunk), medians over the rounds")
    print("| case | layers | dense | lean | dense / layers | lean / dense |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        m = measure(case, args.rounds, args.reps_scale)
        print(f"| {case[0]} | {m['layers']:.1f} | {m['dense']:.1f} | {m['lean']:.1f} | "
              f"{m['dense'] / m['layers']:.3f} | {m['lean'] / m['dense']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
