"""``mpipar bench``: mpipar beside its limits and peers, one subprocess per BLAS thread count.

Per thread count (a fresh process, so BLAS sizes its pool from the variables set here):
the float32 GEMM peak (square product) and the GEMM rate at the model's own matrix sizes; per
config, mpipar's one-rank GPT training step (forward, backward, AdamW) beside the same model in
PyTorch eager, interleaved step by step, medians; FLOP/s and MFU; memory against an analytic
count. Outside quick mode, also mpipar's Comm beside raw mpi4py in a 2-rank mpiexec.

FLOPs per step: ``mpipar.analysis.flops.flops_per_step`` (Megatron's model FLOPs,
6 N T + 12 l s h T with N = 12 l h^2 + V h). MFU = achieved FLOP/s / measured GEMM peak.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from .steps import CONFIGS

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
FLOP_FORMULA = ("FLOPs/step = 6*N*T + 12*l*s*h*T, N = 12*l*h^2 + V*h, T = batch*seq "
                "(mpipar.analysis.flops); MFU = achieved FLOP/s / measured float32 GEMM peak")


def parse_list(text: str, what: str, allowed=None, cast=str) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--{what} is empty: give a comma-separated list")
    try:
        vals = [cast(s) for s in items]
    except ValueError:
        raise ValueError(f"--{what} {text!r}: expected comma-separated {cast.__name__}s") from None
    if allowed is not None:
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise ValueError(f"--{what}: unknown {bad}; choose from {sorted(allowed)}")
    if cast is int and any(v < 1 for v in vals):
        raise ValueError(f"--{what}: thread counts must be >= 1, got {vals}")
    return vals


def _run(cmd, env, timeout, what):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_threads(threads, configs, iters, warmup, quick, use_torch, tmpdir) -> dict:
    env = dict(os.environ)
    for v in THREAD_VARS:
        env[v] = str(threads)
    path = os.path.join(tmpdir, f"threads{threads}.json")
    cmd = [sys.executable, "-m", "mpipar.bench.worker", "--threads", str(threads),
           "--configs", ",".join(configs), "--iters", str(iters), "--warmup", str(warmup),
           "--json", path] + (["--quick"] if quick else []) + ([] if use_torch else ["--no-torch"])
    _run(cmd, env, 3600, f"benchmark worker ({threads} threads)")
    with open(path) as f:
        return json.load(f)


def run_comm(tmpdir, iters=10) -> dict | None:
    """The 2-rank comm table, or None (with a note) when mpiexec is missing."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None
    env = dict(os.environ)
    for v in THREAD_VARS:
        env[v] = "1"
    path = os.path.join(tmpdir, "comm.json")
    _run([mpiexec, "-n", "2", sys.executable, "-m", "mpipar.bench.comm_worker", "--json", path,
          "--iters", str(iters)], env, 600, "comm benchmark (mpiexec -n 2)")
    with open(path) as f:
        return json.load(f)


def run_bench(threads=(1, 2), configs=("small", "large"), iters=10, warmup=2, quick=False,
              use_torch=True, comm=None) -> dict:
    """All measurements; ``comm`` defaults to ``not quick``."""
    comm = (not quick) if comm is None else comm
    result = {"quick": quick, "iters": iters, "warmup": warmup, "flop_formula": FLOP_FORMULA,
              "runs": [], "comm": None, "comm_asked": comm, "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-") as tmp:
        for n in threads:
            result["runs"].append(run_threads(n, configs, iters, warmup, quick, use_torch, tmp))
        if comm:
            result["comm"] = run_comm(tmp)
    return result


# ----- output ---------------------------------------------------------------------------------

def _mb(b):
    return b / 2**20


def _label(r) -> str:
    """The thread count, or "gpu" for a CUDA run."""
    return "gpu" if r.get("device") == "cuda" else str(r["threads"])


def format_tables(res) -> str:
    lines = [f"mpipar bench: float32, one rank, {res['iters']} interleaved steps after "
             f"{res['warmup']} warm-up, medians ({res['cpu_count']} cores)", FLOP_FORMULA, ""]
    notes = {r["torch_note"] for r in res["runs"] if not r["torch"]}
    lines.append("training step (forward + backward + AdamW), tokens/s")
    lines.append(f"{'config':>7} {'thr':>3} {'mpipar':>9} {'torch':>9} {'ratio':>6} "
                 f"{'mpipar GF/s':>11} {'torch GF/s':>10} {'GEMM peak':>9} {'at shapes':>9} "
                 f"{'MFU':>5} {'MFU@shp':>7}")
    for r in res["runs"]:
        for name, c in r["configs"].items():
            m, t = c["mpipar"], c.get("torch")
            tt = f"{t['tokens_per_s']:9.0f}" if t else f"{'-':>9}"
            ratio = f"{m['tokens_per_s'] / t['tokens_per_s']:6.2f}" if t else f"{'-':>6}"
            tg = f"{t['flops_per_s'] / 1e9:10.1f}" if t else f"{'-':>10}"
            lines.append(
                f"{name:>7} {_label(r):>3} {m['tokens_per_s']:9.0f} {tt} {ratio} "
                f"{m['flops_per_s'] / 1e9:11.1f} {tg} {r['gemm_peak'] / 1e9:9.1f} "
                f"{c['gemm_shape_rate'] / 1e9:9.1f} {m['flops_per_s'] / r['gemm_peak']:5.2f} "
                f"{m['flops_per_s'] / c['gemm_shape_rate']:7.2f}")
    lines.append("(ratio = mpipar / torch tokens/s; GEMM peak: square float32 product, GF/s; "
                 "at shapes: the step's own products back to back; MFU@shp against that)")
    for note in sorted(notes):
        lines.append(f"torch column skipped: {note}")
    lines += ["", "memory per rank, MiB (analytic: 4 P resident + activations; measured: "
              "resident arrays + tracemalloc peak of one step)",
              f"{'config':>7} {'thr':>3} {'resident':>9} {'activ.':>8} {'analytic':>9} "
              f"{'step peak':>9} {'measured':>9} {'meas/ana':>8} {'maxrss':>8}"]
    for r in res["runs"]:
        for name, c in r["configs"].items():
            a, m = c["memory_analytic"], c["memory_measured"]
            lines.append(f"{name:>7} {_label(r):>3} {_mb(a['resident']):9.1f} "
                         f"{_mb(a['activations']):8.1f} {_mb(a['total']):9.1f} "
                         f"{_mb(m['step_peak']):9.1f} {_mb(m['total']):9.1f} "
                         f"{m['total'] / a['total']:8.2f} {_mb(r['ru_maxrss_bytes']):8.0f}")
    lines.append("(maxrss: the whole worker process, torch included)")
    if res.get("comm"):
        from mpipar.mpi.bench import format_size

        lines += ["", "communication, 2 ranks: mpipar Comm beside raw mpi4py (medians, us)",
                  f"{'op':>9} {'bytes':>6} {'raw':>9} {'comm':>9} {'comm/raw':>8}"]
        for op in ("p2p", "allreduce"):
            for row in res["comm"][op]:
                lines.append(f"{op:>9} {format_size(int(row[0])):>6} {row[1] * 1e6:9.1f} "
                             f"{row[2] * 1e6:9.1f} {row[3]:8.2f}")
    elif res.get("comm_asked"):
        lines.append("\ncommunication: skipped (no mpiexec on PATH)")
    return "\n".join(lines)


def write_hdf5(path, res) -> None:
    """/throughput, /memory, /gemm_shapes, /comm_p2p, /comm_allreduce (structured tables),
    /samples/<config>/threads<n>/<side> (step times, s); run settings as attributes."""
    import h5py
    import numpy as np

    tp_dt = np.dtype([("config", "S16"), ("threads", "i4"), ("tokens", "i8"),
                      ("flops_per_step", "f8"), ("mpipar_tokens_per_s", "f8"),
                      ("torch_tokens_per_s", "f8"), ("ratio", "f8"), ("mpipar_flops_per_s", "f8"),
                      ("gemm_peak", "f8"), ("gemm_shape_rate", "f8"), ("mfu", "f8"),
                      ("mfu_at_shapes", "f8")])
    mem_dt = np.dtype([("config", "S16"), ("threads", "i4"), ("analytic_resident", "i8"),
                       ("analytic_activations", "i8"), ("analytic_total", "i8"),
                       ("measured_resident", "i8"), ("measured_step_peak", "i8"),
                       ("measured_total", "i8"), ("ru_maxrss", "i8")])
    g_dt = np.dtype([("config", "S16"), ("threads", "i4"), ("gemm", "S16"), ("count", "i4"),
                     ("flops", "f8"), ("seconds", "f8"), ("flops_per_s", "f8")])
    tp, mem, gm = [], [], []
    for r in res["runs"]:
        for name, c in r["configs"].items():
            m, t = c["mpipar"], c.get("torch")
            tts = t["tokens_per_s"] if t else np.nan
            tp.append((name, r["threads"], c["tokens"], c["flops_per_step"], m["tokens_per_s"],
                       tts, m["tokens_per_s"] / tts, m["flops_per_s"], r["gemm_peak"],
                       c["gemm_shape_rate"], m["flops_per_s"] / r["gemm_peak"],
                       m["flops_per_s"] / c["gemm_shape_rate"]))
            a, ms = c["memory_analytic"], c["memory_measured"]
            mem.append((name, r["threads"], a["resident"], a["activations"], a["total"],
                        ms["resident"], ms["step_peak"], ms["total"], r["ru_maxrss_bytes"]))
            gm += [(name, r["threads"], *row) for row in c["gemm_shapes"]]
    with h5py.File(path, "w") as f:
        f.attrs["kind"] = "bench"
        f.attrs["flop_formula"] = FLOP_FORMULA
        for k in ("quick", "iters", "warmup", "cpu_count"):
            f.attrs[k] = res[k]
        f.attrs["torch_note"] = json.dumps({r["threads"]: r["torch_note"] for r in res["runs"]})
        f.attrs["configs"] = json.dumps(CONFIGS)
        f.create_dataset("throughput", data=np.array(tp, dtype=tp_dt))
        f.create_dataset("memory", data=np.array(mem, dtype=mem_dt))
        f.create_dataset("gemm_shapes", data=np.array(gm, dtype=g_dt))
        for r in res["runs"]:
            for name, c in r["configs"].items():
                for side, ts in c["samples"].items():
                    f.create_dataset(f"samples/{name}/threads{r['threads']}/{side}",
                                     data=np.asarray(ts))
        if res.get("comm"):
            for op in ("p2p", "allreduce"):
                f.create_dataset(f"comm_{op}", data=np.asarray(res["comm"][op]))
                f[f"comm_{op}"].attrs["columns"] = "bytes,raw_s,comm_s,ratio,raw_gbps,comm_gbps"
