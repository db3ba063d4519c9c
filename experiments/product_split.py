"""Micro-benchmark: a product split over two kernel threads against the same on one thread.

``mpipar.nn.cpu.matmul`` splits a product's output rows over the kernel threads when it has at
least ``PARALLEL_MIN_MNK`` multiply-adds; each hand-off to a thread costs tens of microseconds,
so below some size one thread is faster. This measures, at a config's linear-layer shapes (per
micro-batch: tokens = batch / microbatches * seq) and at a ladder of sizes, the forward, input
gradient and weight gradient products both ways (the split forced on, whatever the threshold),
median of ``--reps`` in turns, and prints the ratio. The bits are the same either way
(tests/test_cpu_threads.py). Take the numbers on a quiet machine only.

Run: ``python experiments/product_split.py [--config experiments/configs/tiny.toml]
[--threads 2] [--reps 50]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of the GPT's linear products per micro-batch."""
    m = cfg.train.batch_size // cfg.parallel.microbatches * cfg.train.seq_len
    d, v = cfg.model.n_embd, cfg.model.vocab_size
    out = []
    for name, k, n in (("qkv", d, 3 * d), ("mlp.fc", d, 4 * d), ("mlp.proj", 4 * d, d),
                       ("head", d, v)):
        out += [(f"{name} fwd", m, k, n), (f"{name} dx", m, n, k), (f"{name} dw", k, m, n)]
    return out


def time_product(cpu, np, m, k, n, threads, reps):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    cpu.set_kernel_threads(threads)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cpu.matmul(np, a, b, out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "experiments" / "configs" / "tiny.toml"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from mpipar.config import load_config
    from mpipar.nn import cpu

    cfg = load_config(args.config)
    ladder = [(f"square {s}", s, s, s) for s in (64, 96, 128, 192, 256, 384, 512)]
    cpu.PARALLEL_MIN_MNK = 0  # force the split; one thread never splits
    print(f"{'product':<16}{'m x k x n':>18}{'MNK':>12}{'1 thread us':>14}"
          f"{f'{args.threads} threads us':>16}{'split/one':>11}")
    for name, m, k, n in shapes(cfg) + ladder:
        one = time_product(cpu, np, m, k, n, 1, args.reps)
        many = time_product(cpu, np, m, k, n, args.threads, args.reps)
        print(f"{name:<16}{f'{m} x {k} x {n}':>18}{m * k * n:>12,}{1e6 * one:>14.1f}"
              f"{1e6 * many:>16.1f}{many / one:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
