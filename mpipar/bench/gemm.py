"""GEMM throughput of the array library: the ceiling for any model built on its matmuls.

``mpipar.perf.measure_gemm_peak`` times a square product (the library's best case; it lives in
the core, which records it, and never imports this tool); ``model_gemm_shapes``
lists the products one GPT training step makes, so ``gemm_rate_at_shapes`` gives the rate the
library reaches at exactly those sizes (small or skinny products run below the square peak).
FLOPs of an (m, k) @ (k, n) product: 2 m k n (one multiply and one add per term).
"""

from __future__ import annotations

import numpy as np

from mpipar.perf import time_matmul


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
