"""Shared plumbing of the experiment scripts: launching runs, writing tables and plots.

Every experiment is a plain script (``python experiments/<name>.py``) that starts its own
``mpiexec`` subprocesses, one per configuration, with one BLAS/OpenMP thread per rank (ranks
oversubscribe the machine's cores; more threads would only fight over them). Each run writes
``OUT/<run>/trace.h5``; the script analyses the dumps with ``mpipar.analysis`` and writes
``OUT/results.csv``, ``OUT/results.json`` and ``OUT/<name>.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"

# one thread per rank: ranks already outnumber cores, BLAS threads would oversubscribe further
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


class ExperimentError(RuntimeError):
    """A run failed or timed out; the message holds the command and the end of its output."""


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=doc.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help=f"output directory (default runs/experiments/{name})")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and few configurations: seconds, for tests")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run (step 0 is skipped as warm-up by the analysis)")
    p.add_argument("--reuse", action="store_true",
                   help="skip runs whose complete trace.h5 already exists (re-analyse only)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a single run is killed (default 300)")
    return p


def out_dir(args, name: str) -> Path:
    out = Path(args.out) if args.out else ROOT / "runs" / "experiments" / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def env() -> dict:
    e = dict(os.environ)
    e.update(THREAD_ENV)
    return e


def run_command(cmd: list[str], timeout: float, label: str) -> str:
    """Run ``cmd`` in its own process group; kill that group on timeout. Returns its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and the ranks it started, nothing else
        output, _ = proc.communicate()
        raise ExperimentError(f"{label}: timed out after {timeout:.0f} s (raise --timeout): "
                              f"{' '.join(cmd)}\n{output[-2000:]}") from None
    if proc.returncode != 0:
        raise ExperimentError(f"{label}: exit status {proc.returncode}: {' '.join(cmd)}\n"
                              f"{output[-3000:]}")
    print(f"  {label}: {time.perf_counter() - t0:.1f} s", flush=True)
    return output


def complete_dump(run_dir: Path) -> bool:
    path = run_dir / "trace.h5"
    if not path.is_file():
        return False
    try:
        import h5py

        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("complete", False))
    except OSError:
        return False


def train(run_dir: Path, ranks: int, config: Path, sets: dict, args, flags=()) -> Path:
    """``mpiexec -n ranks mpipar train`` with ``--set`` overrides; returns RUN_DIR/trace.h5."""
    run_dir = Path(run_dir)
    if args.reuse and complete_dump(run_dir):
        print(f"  {run_dir.name}: reused", flush=True)
        return run_dir / "trace.h5"
    over = {"run.progress": "false", "train.eval_interval": "0", "run.flush_interval": "0"}
    over.update({k: _value(v) for k, v in sets.items()})
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpipar.cli", "train",
           "--config", str(config), "--out", str(run_dir)]
    cmd += list(flags)
    for k, v in over.items():
        cmd += ["--set", f"{k}={v}"]
    run_command(cmd, args.timeout, run_dir.name)
    return run_dir / "trace.h5"


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def balanced_boundaries(n_layer: int, n_chunks: int) -> list[int]:
    """Explicit chunk starts over the GPT's units (embedding, n_layer blocks, head) giving every
    chunk the same number of blocks: the embedding joins the first chunk, the head the last
    (both are cheap next to a block here), so the stages are balanced, as the formulas assume."""
    if n_layer % n_chunks:
        raise ValueError(f"n_layer = {n_layer} must be a multiple of pp * virtual = {n_chunks} "
                         f"for balanced stages")
    per = n_layer // n_chunks
    return [0] + [1 + k * per for k in range(1, n_chunks)]


# --- tables -------------------------------------------------------------------------------------

def _cell(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def text_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy scalar
        return _clean(v.item())
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_results(out: Path, name: str, rows: list[dict], columns: list[str],
                  meta: dict | None = None) -> None:
    """Print the table; write results.csv (the columns), results.json (all fields), results.md."""
    rows = [{k: _clean(v) for k, v in r.items()} for r in rows]
    print(f"\n{name}:\n{text_table(rows, columns)}\n", flush=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    doc = {"experiment": name, "meta": meta or {}, "columns": columns, "rows": rows}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown_table(rows, columns) + "\n")
    print(f"wrote {out / 'results.csv'}, results.json, results.md", flush=True)


def pyplot():
    """matplotlib with the file-only backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine_note() -> dict:
    """What the numbers were measured on: cores available versus ranks started."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "loadavg_at_end": load, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def bubble_model(args, quick_steps: int, steps: int):
    """The model the bubble experiments (bubble.py, calibrate.py) train: exp_bubble.toml with 8
    blocks, or 4 small ones with --quick. Returns (config path, base overrides, n_layer)."""
    base = {"train.steps": args.steps or (quick_steps if args.quick else steps)}
    n_layer = 8
    if args.quick:
        n_layer = 4
        base.update({"model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2,
                     "train.seq_len": 16, "train.batch_size": 8})
    return CONFIGS / "exp_bubble.toml", base, n_layer
