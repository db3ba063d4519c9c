"""mpipar's own CPU threads, measured (BENCHMARKS.md, "How the CPU kernels get there").

1. Products: a linear layer's three products (forward, input gradient, weight gradient) split by
   mpipar into one single-threaded product per kernel thread (``mpipar.nn.cpu.matmul``), beside
   the same product on OpenBLAS's own threads; the same process, in turns, best of repeats.
2. Where a training step's time goes: mpipar's leaf kernels wrapped with ``perf_counter``, one
   rank, float32, medians of the steps, on one and on ``--threads`` threads.

Run: ``python experiments/cpu_threads.py [--config small|large] [--threads 2] [--steps 7]``.
Set nothing beforehand: the script sizes the thread pools itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time


def _blas_weight_grad(x, dy, dw, tmp):
    import numpy as np

    np.matmul(x.T, dy, out=tmp)
    dw += tmp


def product_rates(sh, threads, reps=10, runs=3, pause=0.3):
    import numpy as np

    from mpipar.nn import cpu
    from mpipar.nn import functional as F

    t, d, v = sh.tokens, sh.n_embd, sh.vocab_size
    rng = np.random.default_rng(0)
    cpu.set_kernel_threads(threads)
    rows = []
    for name, k, n in (("qkv", d, 3 * d), ("mlp.fc", d, 4 * d), ("mlp.proj", 4 * d, d),
                       ("head", d, v)):
        x = rng.standard_normal((t, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        dy = rng.standard_normal((t, n), dtype=np.float32)
        dw = np.zeros((k, n), np.float32)
        flops = 2.0 * t * k * n
        out, dx, tmp = (np.empty((t, n), np.float32), np.empty((t, k), np.float32),
                        np.empty((k, n), np.float32))

        kinds = {"forward": ((F.linear_forward, (x, w)),
                             (np.matmul, (x, w, out))),
                 "input grad": ((F.linear_backward_input, (dy, w)),
                                (np.matmul, (dy, w.T, dx))),
                 "weight grad": ((F.linear_backward_weight, (x, dy, dw)),
                                 (_blas_weight_grad, (x, dy, dw, tmp)))}
        for kind, sides in kinds.items():
            best = [1e9, 1e9]
            for _ in range(runs):
                for i, (fn, args) in enumerate(sides):
                    # mpipar: its kernel threads, BLAS on one; then plain NumPy on BLAS's own.
                    # In runs, after a pause: OpenBLAS's idle workers spin for ~0.1 s after
                    # each product, and would take the core from mpipar's next one.
                    time.sleep(pause)
                    with cpu.blas_threads(1 if i == 0 else threads):
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            fn(*args)
                            best[i] = min(best[i], time.perf_counter() - t0)
            rows.append((name, kind, flops / best[0] / 1e9, flops / best[1] / 1e9))
    return rows


GROUPS = {"products": ["linear_forward", "linear_backward_input", "linear_backward_weight"],
          "attention": ["attention_forward", "attention_backward"],
          "GELU": ["gelu_forward", "gelu_backward"],
          "LayerNorm": ["layernorm_forward", "layernorm_backward_input",
                        "layernorm_backward_weight"],
          "embedding": ["embedding_forward", "embedding_backward_weight"]}


def step_profile(sh, threads, steps):
    import numpy as np

    from mpipar.bench.steps import mpipar_step
    from mpipar.nn import cpu
    from mpipar.nn import functional as F
    from mpipar.nn import optim as O

    spent = collections.defaultdict(float)

    def wrap(owner, name, group):
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[group] += time.perf_counter() - t0

        setattr(owner, name, timed)
        return fn

    originals = [(F, n, wrap(F, n, g)) for g, names in GROUPS.items() for n in names]
    originals.append((O.AdamW, "step", wrap(O.AdamW, "step", "AdamW")))
    try:
        step = mpipar_step(sh)[0]
        out = {}
        for n in (1, threads):
            cpu.set_kernel_threads(n)
            with cpu.blas_threads(1):  # mpipar's own setting; with one thread, BLAS's too
                for _ in range(2):
                    step()
                per = collections.defaultdict(list)
                for _ in range(steps):
                    spent.clear()
                    t0 = time.perf_counter()
                    step()
                    total = time.perf_counter() - t0
                    per["step"].append(total)
                    for g in [*GROUPS, "AdamW"]:
                        per[g].append(spent[g])
                    per["rest"].append(total - sum(spent.values()))
            out[n] = {k: float(np.median(v)) * 1e3 for k, v in per.items()}
        return out
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--quick", action="store_true",
                    help="no pauses, few repeats: a smoke test (what tests run), not a measurement")
    a = ap.parse_args(argv)
    if a.threads < 2:
        ap.error("--threads must be >= 2 (the comparison is against one thread)")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)  # before NumPy loads: BLAS's pool can reach it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mpipar.bench.steps import shape

    sh = shape(a.config)
    print(f"products of the {a.config} config, float32, {a.threads} threads, GF/s "
          "(best of 3 runs of 10 each)" if not a.quick else "(--quick: not a measurement)")
    print(f"{'layer':>9} {'product':>12} {'mpipar split':>13} {'OpenBLAS threads':>17}")
    opts = dict(reps=2, runs=1, pause=0.0) if a.quick else {}
    for name, kind, mine, blas in product_rates(sh, a.threads, **opts):
        print(f"{name:>9} {kind:>12} {mine:13.0f} {blas:17.0f}")
    prof = step_profile(sh, a.threads, a.steps)
    print(f"\none {a.config} training step (forward, backward, AdamW), median of {a.steps}, ms")
    print(f"{'':>10} {'1 thread':>9} {f'{a.threads} threads':>10}")
    for k in ["step", *GROUPS, "AdamW", "rest"]:
        print(f"{k:>10} {prof[1][k]:9.1f} {prof[a.threads][k]:10.1f}")
    print(f"{'speedup':>10} {'':>9} {prof[1]['step'] / prof[a.threads]['step']:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
