"""GEMM throughput of the array library: the ceiling for any model built on its matmuls.

``measure_gemm_peak`` times a square product (the library's best case); ``model_gemm_shapes``
lists the products one GPT training step makes, so ``gemm_rate_at_shapes`` gives the rate the
library reaches at exactly those sizes (small or skinny products run below the square peak).
FLOPs of an (m, k) @ (k, n) product: 2 m k n (one multiply and one add per term).
"""

from __future__ import annotations

import time

import numpy as np


def _sync(xp):
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def time_matmul(xp, a, b, seconds=0.2, min_reps=3, out=None):
    """Median seconds of ``a @ b`` (batched if 3-D), repeated for about ``seconds``."""
    out = xp.matmul(a, b) if out is None else out
    _sync(xp)
    times, t_end = [], time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < t_end:
        t = time.perf_counter()
        xp.matmul(a, b, out=out)
        _sync(xp)
        times.append(time.perf_counter() - t)
        if len(times) >= 10_000:
            break
    return float(np.median(times))


def measure_gemm_peak(dtype=np.float32, n: int = 1024, seconds: float = 0.5, xp=None) -> float:
    """Achieved FLOP/s of an n x n x n product in ``dtype`` (median of repeats over ``seconds``).

    Uses whatever BLAS threads the process has; the caller chooses them (threadpoolctl or the
    *_NUM_THREADS variables before NumPy loads). ``xp`` defaults to NumPy; pass cupy for a GPU.
    """
    xp = np if xp is None else xp
    if n < 1 or seconds <= 0:
        raise ValueError(f"measure_gemm_peak needs n >= 1 and seconds > 0, got {n}, {seconds}")
    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((n, n)), dtype=dtype)
    b = xp.asarray(rng.standard_normal((n, n)), dtype=dtype)
    return 2.0 * n * n * n / time_matmul(xp, a, b, seconds)


def model_gemm_shapes(n_layer, n_embd, n_head, vocab, batch, seq):
    """[(name, count per step, (batch dims..., m, k), (k, n))] of one GPT training step.

    Forward products; the backward makes two of the same FLOPs per forward product (input and
    weight gradients, same m, k, n up to transposition), so the step counts each one 3 times.
    """
    t, d, hd = batch * seq, n_embd, n_embd // n_head
    bh = batch * n_head
    return [
        ("qkv", 3 * n_layer, (t, d), (d, 3 * d)),
        ("attn.proj", 3 * n_layer, (t, d), (d, d)),
        ("mlp.fc", 3 * n_layer, (t, d), (d, 4 * d)),
        ("mlp.proj", 3 * n_layer, (t, 4 * d), (4 * d, d)),
        ("head", 3, (t, d), (d, vocab)),
        ("attn.qk", 3 * n_layer, (bh, seq, hd), (bh, hd, seq)),
        ("attn.pv", 3 * n_layer, (bh, seq, seq), (bh, seq, hd)),
    ]


def shape_flops(a_shape, b_shape) -> float:
    batch = 1
    for s in a_shape[:-2]:
        batch *= s
    return 2.0 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]


def gemm_rate_at_shapes(shapes, dtype=np.float32, seconds=0.1, xp=None):
    """Per shape: (name, count, flops, seconds, FLOP/s); plus the step's FLOP-weighted rate
    (total FLOPs / total time: the fastest the step's products can run back to back)."""
    xp = np if xp is None else xp
    rng = np.random.default_rng(1)
    rows, tot_f, tot_t = [], 0.0, 0.0
    for name, count, ash, bsh in shapes:
        a = xp.asarray(rng.standard_normal(ash), dtype=dtype)
        b = xp.asarray(rng.standard_normal(bsh), dtype=dtype)
        sec = time_matmul(xp, a, b, seconds)
        f = shape_flops(ash, bsh)
        rows.append((name, count, f, sec, f / sec))
        tot_f += count * f
        tot_t += count * sec
    return rows, tot_f / tot_t
