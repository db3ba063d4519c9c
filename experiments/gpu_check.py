"""GPU check: the CuPy path against the NumPy path, and a timing run. Under 5 minutes on one GPU.

    python experiments/gpu_check.py [--out DIR] [--quick]

Needs CuPy and a CUDA device; downloads nothing. Sections (each one reports and the script goes
on if one fails):
1. environment: CuPy, CUDA, device, mpi4py and the MPI library, CUDA-aware detection;
2. agreement: the GPU-marked exactness tests (tests/test_gpu.py), then the GPT loss and every
   gradient on CuPy vs NumPy in float64 (max relative error), per kernel and for the model;
3. multi-rank exactness on the GPU: 2 ranks (tp=2, and pp=2) comparing with one rank, float64,
   through the communication layer's staged path (and CUDA-aware if the MPI library is);
4. timing: one-rank GPT forward+backward+AdamW tokens/s, NumPy on the host vs CuPy, float32,
   for the tiny and small configs, and a 2-rank tp=2 training run on the GPU.
Writes DIR/gpu_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

RESULTS: dict = {}
DEVICE = "cuda"  # --dry-run: "cpu" everywhere, to check this script itself without a GPU


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **kw)
                status = "ok"
            except Exception as exc:  # report and go on: one broken part must not hide the rest
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
                status = "FAILED"
            print(f"== {name}: {status} ({time.perf_counter() - t:.1f} s)", flush=True)
            print(json.dumps(RESULTS[name], indent=1, default=str)[:3000], flush=True)
        return run
    return wrap


@section("environment")
def environment():
    import cupy as cp

    from mpipar.mpi import cuda_aware, library_version

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    out = {"cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
           "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
           "memory_gib": round(dev.mem_info[1] / 2**30, 1), "numpy": np.__version__}
    try:
        out["mpi"] = library_version()
        out["cuda_aware"] = cuda_aware()
    except Exception as exc:
        out["mpi"] = f"unavailable: {exc}"
    return out


@section("pytest -m gpu")
def gpu_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                          str(REPO / "tests/test_gpu.py")], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    return {"returncode": res.returncode, "tail": res.stdout.strip().splitlines()[-3:]}


@section("agreement (float64, CuPy vs NumPy)")
def agreement():
    from test_gpu import rel, run_model
    from test_models import CASES, data_for

    from mpipar.backend import Backend

    out = {}
    for label, mcfg in (("gpt", CASES[0]), ("gpt-tied", CASES[1]), ("mlp", CASES[2])):
        x, y = data_for(mcfg, np.random.default_rng(0), b=4, s=8)
        l_np, g_np = run_model(mcfg, Backend("cpu", "float64"), x, y)
        l_cp, g_cp = run_model(mcfg, Backend(DEVICE, "float64"), x, y)
        worst = max((rel(g_cp[k], g_np[k]), k) for k in g_np)
        out[label] = {"loss_rel_err": abs(l_np - l_cp) / abs(l_np), "worst_grad_rel_err": worst[0],
                      "worst_param": worst[1]}
    return out


def _mpi_equiv(n, dp, pp, tp, variants, data, env_extra):
    env = {**os.environ, "MPIPAR_TEST_DEVICE": DEVICE, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), **env_extra}
    cmd = ["mpiexec", "-n", str(n), sys.executable, str(REPO / "tests/mpi/equiv_train.py"), data,
           str(dp), str(pp), str(tp), *variants]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln[:4] in ("ok  ", "FAIL")]
    return {"returncode": res.returncode, "results": lines,
            "stderr_tail": res.stderr.strip().splitlines()[-4:] if res.returncode else []}


@section("multi-rank exactness on the GPU (float64)")
def multirank(tmp):
    from mpipar.datasets import prepare_synthetic

    data = str(tmp / "markov.h5")
    prepare_synthetic(data, "markov", 20000, 256, seed=0)
    out = {}
    for label, force in (("staged", {"MPIPAR_CUDA_AWARE": "0"}), ("auto", {})):
        out[f"tp2 {label}"] = _mpi_equiv(2, 1, 1, 2, ["1f1b:2", "1f1b:2:sp"], data, force)
        out[f"pp2 {label}"] = _mpi_equiv(2, 1, 2, 1, ["1f1b:4", "zb-h1:3"], data, force)
    out["dp2 staged"] = _mpi_equiv(2, 2, 1, 1, ["1f1b:2", "1f1b:2:zero1"], data,
                                   {"MPIPAR_CUDA_AWARE": "0"})
    return out


def _tokens_per_s(cfg_name, device, steps, threads=None):
    """One-rank forward+backward+AdamW, timed over ``steps`` after one warm-up step."""
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model
    from mpipar.nn.optim import AdamW

    cfg = load_config(REPO / f"experiments/configs/{cfg_name}.toml")
    bk = Backend(device, "float32")
    model = build_model(cfg.model, bk, seed=0)
    opt = AdamW(model.params(), 1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    x = bk.xp.asarray(rng.integers(0, cfg.model.vocab_size, (b, s)))
    y = bk.xp.asarray(rng.integers(0, cfg.model.vocab_size, (b, s)))

    def step():
        for p in model.params():
            p.zero_grad()
        h = x
        for u in model.units:
            h = u.forward(h, 0)
        model.loss.forward(h, y, 0)
        d = model.loss.backward(0)
        for u in reversed(model.units):
            d = u.backward(d, 0)
        opt.step()
        bk.synchronize()

    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return b * s / float(np.median(times))


@section("timing (float32, one rank, tokens/s)")
def timing(quick):
    out = {}
    for cfg in ("tiny", "small"):
        cpu = _tokens_per_s(cfg, "cpu", 2 if quick else 5)
        gpu = _tokens_per_s(cfg, DEVICE, 5 if quick else 20)
        out[cfg] = {"numpy_cpu_tok_s": round(cpu), "cupy_gpu_tok_s": round(gpu),
                    "gpu_over_cpu": round(gpu / cpu, 2)}
    return out


@section("training run on the GPU (mpiexec -n 2, tp=2, small config)")
def train_run(tmp, quick):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out_dir = tmp / "train_gpu"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpipar.cli", "train", "--config",
           str(REPO / "experiments/configs/small.toml"), "--device", DEVICE, "--tp", "2",
           "--steps", "10" if quick else "30", "--out", str(out_dir), "--quiet",
           "--set", "train.eval_interval=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    out = {"returncode": res.returncode, "stdout_tail": res.stdout.strip().splitlines()[-2:]}
    if res.returncode:
        out["stderr_tail"] = res.stderr.strip().splitlines()[-6:]
    else:
        out["metrics"] = {k: v for k, v in json.loads((out_dir / "metrics.json").read_text())
                          .items() if k != "losses"}
        try:
            from mpipar.analysis import summarize

            s = summarize(out_dir / "trace.h5")
            out["breakdown"] = {k: s["summary"].get(k) for k in
                                ("step_time", "tokens_per_s", "compute_share", "comm_share")}
        except Exception as exc:
            out["breakdown"] = f"analysis failed: {exc}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="run every section on the CPU (checks the script, not the GPU)")
    args = ap.parse_args()
    global DEVICE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mpipar.backend import cupy_available

    ok, why = cupy_available()
    if args.dry_run:
        DEVICE = "cpu"
    elif not ok:
        print(f"gpu_check: no GPU here ({why}); nothing to check (--dry-run runs it on the CPU)",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if not args.dry_run:
        environment()
        gpu_tests()
    agreement()
    multirank(out)
    timing(args.quick)
    train_run(out, args.quick)
    RESULTS["total_seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print(f"gpu_check: wrote {out / 'gpu_check.json'} in {RESULTS['total_seconds']} s")
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
