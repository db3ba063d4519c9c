"""The GEMM peak of a device: what the trainer records for MFU and ``mpipar bench`` compares with.

A small measurement both use (the core never imports the ``bench`` tool): ``measure_gemm_peak``
times a square product (the array library's best case); ``device_peak`` turns it into the peak
of one device as docs/dump_schema.md defines it. FLOPs of an (m, k) @ (k, n) product: 2 m k n.
"""

from __future__ import annotations

import os
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


def device_peak(backend, ranks_on_host: int = 1, seconds: float = 0.2) -> float:
    """The GEMM peak of one device for MFU (see docs/dump_schema.md).

    On a GPU: the rate of a large matrix product there. On the CPU the host is the device: the
    rate one rank reaches with its BLAS threads, times the cores this host's ``ranks_on_host``
    ranks use (capped at the host's cores): what all of them together could reach.
    """
    rate = measure_gemm_peak(backend.dtype, n=1024 if backend.is_gpu else 512, seconds=seconds,
                             xp=backend.xp)
    if backend.is_gpu:
        return rate
    cores = os.cpu_count() or 1
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
                  or cores)
    return rate / threads * min(ranks_on_host * threads, cores)
