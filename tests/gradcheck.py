"""Finite-difference helpers for float64 gradient checks."""

import numpy as np


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), np.max(np.abs(b)), 1e-300))


def numeric_grad(f, x, eps=1e-6, n_samples=None, rng=None):
    """Central differences of scalar f() w.r.t. the array x (modified in place and restored).

    With ``n_samples``, only that many random entries are probed; returns (indices, grads).
    """
    flat = x.reshape(-1)
    if n_samples is None or n_samples >= flat.size:
        idx = np.arange(flat.size)
    else:
        idx = (rng or np.random.default_rng(0)).choice(flat.size, n_samples, replace=False)
    g = np.empty(len(idx))
    for j, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        g[j] = (fp - fm) / (2 * eps)
    return idx, g
