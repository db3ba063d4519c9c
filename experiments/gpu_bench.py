"""The ``mpipar bench`` training-step comparison on one GPU: mpipar on CuPy beside PyTorch on the
same GPU (if torch with CUDA is installed; else CuPy alone, with a note), plus the cuBLAS float32
GEMM peak and the GEMM rate at the model's own sizes, and memory against the analytic count.

    python experiments/gpu_bench.py --out gpu_bench.h5          # on the GPU machine (< 5 min)
    python experiments/gpu_bench.py --dry-run --out /tmp/g.h5   # anywhere: NumPy, tiny shapes

Plain float32 on both sides (torch's TF32 switched off; CuPy uses TF32 only if CUPY_TF32=1 is
set, which this script refuses). The table is printed and written to --out (HDF5, the layout of
``mpipar bench``) and to a text file beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def check_against_cpu(device: str) -> float:
    """Largest relative error of a tiny float64 GPT's loss and gradients, ``device`` vs NumPy."""
    import numpy as np

    from mpipar.backend import Backend, to_numpy
    from mpipar.config import ModelConfig
    from mpipar.models import build_model

    mcfg = ModelConfig(kind="gpt", vocab_size=19, block_size=16, n_layer=2, n_embd=16, n_head=4,
                       init_std=0.3)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, 19, size=(3, 16)) for _ in range(2))
    out = []
    for dev in ("cpu", device):
        bk = Backend(dev, "float64")
        model = build_model(mcfg, bk, seed=1)
        h = bk.xp.asarray(x)
        for u in model.units:
            h = u.forward(h, 0)
        loss = model.loss.forward(h, bk.xp.asarray(y), 0, 1.0)
        d = model.loss.backward(0)
        for u in reversed(model.units):
            d = u.backward(d, 0)
        out.append([np.array([loss])] + [to_numpy(p.grad) for p in model.params()])
    return max(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-300))
               for a, b in zip(*out, strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=None,
                    help="shapes from mpipar.bench.steps.CONFIGS (default small,large,xl; "
                         "dry run: tiny)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per side (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="CuPy alone")
    ap.add_argument("--dry-run", action="store_true",
                    help="run on the CPU with NumPy and tiny shapes, to check the script")
    ap.add_argument("--out", default="gpu_bench.h5", help="HDF5 result (a .txt table beside it)")
    a = ap.parse_args(argv)
    if os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        print("gpu_bench: unset CUPY_TF32: the comparison is plain float32", file=sys.stderr)
        return 2

    from mpipar.bench.run import format_tables, parse_list, write_hdf5
    from mpipar.bench.steps import CONFIGS
    from mpipar.bench.worker import measure

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda":
        from mpipar.backend import cupy_available

        ok, why = cupy_available()
        if not ok:
            print(f"gpu_bench: {why}; use --dry-run to check the script on the CPU",
                  file=sys.stderr)
            return 2
    try:
        configs = parse_list(a.configs or ("tiny" if a.dry_run else "small,large,xl"),
                             "configs", allowed=CONFIGS)
    except ValueError as exc:
        print(f"gpu_bench: {exc}", file=sys.stderr)
        return 2
    iters = a.iters if a.iters is not None else (3 if a.dry_run else 20)
    t0 = time.time()
    err = check_against_cpu(device)
    print(f"float64 tiny GPT, {device} vs NumPy: max relative error of loss and gradients "
          f"{err:.1e}", flush=True)
    if err > 1e-10:
        print("gpu_bench: the device disagrees with the CPU; not benchmarking", file=sys.stderr)
        return 1
    run = measure(threads=os.cpu_count() or 1, configs=configs, iters=iters, warmup=a.warmup,
                  quick=a.dry_run, use_torch=not a.no_torch, device=device)
    res = {"quick": a.dry_run, "iters": iters, "warmup": a.warmup, "cpu_count": os.cpu_count(),
           "runs": [run], "comm": None}
    if device == "cuda":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        head = f"device: {name}, CuPy {cupy.__version__}"
    else:
        head = "device: CPU (dry run, NumPy)"
    if not run["torch"]:
        head += f"; torch column skipped: {run['torch_note']}"
    head += f"\ncheck: float64 tiny GPT {device} vs NumPy, max rel. error {err:.1e}"
    text = (head + "\n" + format_tables(res)
            + f"\n\n(wall time {time.time() - t0:.0f} s)")
    print(text, flush=True)
    write_hdf5(a.out, res)
    with open(os.path.splitext(a.out)[0] + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"wrote {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
