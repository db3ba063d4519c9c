"""One thread count's measurements, in a process of its own (``python -m mpipar.bench.worker``).

The parent sets OMP/OPENBLAS/MKL_NUM_THREADS before this process imports NumPy (BLAS sizes its
pool at load time); threadpoolctl, if installed, pins it again, and torch gets
``set_num_threads``. Writes a JSON dict of results to --json.
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def _pin_threads(n: int) -> str:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "env"
    threadpool_limits(n)
    return "threadpoolctl"


def interleaved(fns: dict, iters: int, warmup: int) -> dict:
    """Per name, the list of step times; each round runs every fn once, the order rotating."""
    names = list(fns)
    times = {k: [] for k in names}
    for i in range(warmup + iters):
        order = names[i % len(names):] + names[:i % len(names)]
        for k in order:
            t = time.perf_counter()
            fns[k]()
            dt = time.perf_counter() - t
            if i >= warmup:
                times[k].append(dt)
    return times


def measure(threads, configs, iters, warmup, quick, use_torch=True, device="cpu"):
    """All of one process's measurements. ``device="cuda"``: CuPy and torch on the GPU (threads
    then only sizes the host-side pools)."""
    pinned = _pin_threads(threads)
    import numpy as np

    xp = np
    if device == "cuda":
        import cupy as xp

    from mpipar.analysis.flops import flops_per_step
    from mpipar.nn import cpu
    from mpipar.perf import measure_gemm_peak

    from . import torch_ref
    from .gemm import gemm_rate_at_shapes, model_gemm_shapes
    from .memory import analytic_bytes, measured_bytes
    from .steps import mpipar_step, shape

    have_torch, torch_note = torch_ref.available() if use_torch else (False, "disabled")
    if have_torch:
        import torch

        torch.set_num_threads(threads)
        if device == "cuda":
            if not torch.cuda.is_available():
                have_torch, torch_note = False, f"torch {torch.__version__} sees no CUDA device"
            else:  # plain float32 on both sides: no TF32 tensor-core shortcut
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
    out = {"threads": threads, "pinned_by": pinned, "torch": have_torch, "torch_note": torch_note,
           "numpy": np.__version__, "device": device, "configs": {}}
    n_peak, sec = (256, 0.05) if quick else (1024, 0.5)
    if device == "cuda" and not quick:
        n_peak = 8192
    # mpipar runs its kernels on `threads` threads of its own with BLAS on one each
    # (mpipar.nn.cpu); the GEMM peak is BLAS's own, on all `threads`
    cpu.set_kernel_threads(threads)

    def peak():
        with cpu.blas_threads(threads):
            return measure_gemm_peak(np.float32, n=n_peak, seconds=sec, xp=xp)

    def at_shapes(sh):
        with cpu.blas_threads(threads):
            return gemm_rate_at_shapes(
                model_gemm_shapes(sh.n_layer, sh.n_embd, sh.n_head, sh.vocab_size, sh.batch,
                                  sh.seq), seconds=0.02 if quick else 0.1, xp=xp)

    # The machine may be shared: a busy moment can only lower a rate, so each ceiling is the
    # higher of two measurements, one before and one after the steps it is compared with.
    out["gemm_peak"] = peak()
    for name in configs:
        sh = shape(name)
        rows, shape_rate = at_shapes(sh)
        fns = {}
        if device == "cuda":
            xp.get_default_memory_pool().free_all_blocks()
        m_step, model, opt = mpipar_step(sh, device=device)
        fns["mpipar"] = m_step
        if have_torch:
            fns["torch"] = torch_ref.torch_step(sh, device=device)[0]
        times = interleaved(fns, iters, warmup)
        flops = flops_per_step(sh.flops_config())
        rows2, shape_rate2 = at_shapes(sh)
        if shape_rate2 > shape_rate:
            rows, shape_rate = rows2, shape_rate2
        res = {"tokens": sh.tokens, "flops_per_step": flops, "gemm_shape_rate": shape_rate,
               "gemm_shapes": [list(r) for r in rows], "samples": times,
               "n_params": model.n_params_full}
        for k, ts in times.items():
            med = float(np.median(ts))
            res[k] = {"step_s": med, "tokens_per_s": sh.tokens / med, "flops_per_s": flops / med}
        res["memory_analytic"] = analytic_bytes(sh, model.n_params_full)
        res["memory_measured"] = measured_bytes(m_step, model, opt, xp)
        out["configs"][name] = res
    out["gemm_peak"] = max(out["gemm_peak"], peak())
    out["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpipar.bench.worker")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    res = measure(a.threads, a.configs.split(","), a.iters, a.warmup, a.quick, not a.no_torch)
    with open(a.json, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
