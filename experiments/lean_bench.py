"""mpipar beside the lean NumPy + mpi4py loop (mpipar/mpi/bench/lean.py): samples per second of
the same MLP on one rank, dp = 2 and pp = 2 (naive, GPipe, 1F1B), with small and 1024-wide
layers, plus the tiny GPT (experiments/configs/tiny.toml) at pp = 2 and dp = 2.

By default each MLP case is one ``mpiexec`` whose ranks build both the lean loop and mpipar and
run them in short alternating blocks (experiments/lean_samejob.py): the machine's speed drifts
too much between separate jobs for their ratio to mean much. The table gives the median of the
per-block-pair ratios mpipar / lean, their interquartile range, and the median samples/s of
each. ``--separate`` runs each implementation as its own ``mpiexec`` instead, in interleaved
pairs of runs (the GPT cases, which have no lean loop, always run that way). One BLAS thread and
one mpipar kernel thread per rank. ``--checkout DIR`` times the mpipar of another checkout (its
PYTHONPATH); ``--baseline DIR`` adds the mpipar of DIR (before / after a change): same job, one
more job per case, timed against the same lean loop; separate, a third run in each pair. The
lean loop is loaded by file path and imports nothing from mpipar, so it is the same program
whatever checkout is timed.

    python experiments/lean_bench.py [--block 20] [--block-pairs 20] [--separate [--pairs 5]]
        [--out runs/experiments/lean_bench] [--checkout DIR] [--baseline DIR [--rounds 2]]
        [--cases mlp-dp2,gpt-pp2] [--quick]

The lean loop cycles 4 fixed batches (they stay in cache: the floor of the math and messages
alone); ``--lean-data-rows 3686`` makes it draw each step's rows from a set as large as the MLP's
training rows, as mpipar's synthetic data is drawn (a like-for-like step with its data). Either
way each rank holds only what it reads (``Lean.take``): a replica its own rows, a pipeline's
first stage the inputs and its last the classes, as mpipar gathers them.

Before the runs and after them, the machine's steadiness is sampled and printed with the table
(``--steadiness SECONDS``, ``mpipar/plan/steadiness.py``): on a machine whose speed switches
between two levels, how many block pairs or runs a difference of a few per cent needs.

``--profile`` instead runs each case's mpipar once under cProfile and writes, per rank, the
function call counts per training step (``OUT/profile/<case>.rank<R>.txt``): the fixed-cost
budget of BENCHMARKS.md. Writes ``OUT/results.md``, ``OUT/lean_bench_samejob.h5`` (every block
time, ``case/impl/lean`` and ``case/impl/mpipar``) and ``OUT/lean_bench.h5`` (every separate run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAN = ROOT / "mpipar" / "mpi" / "bench" / "lean.py"
SMALL = (784, 128, 127, 126, 125, 124, 123, 10)
WIDE = (784, 1024, 1024, 1024, 1024, 1024, 1024, 10)

# name -> (ranks, lean layout or None (no lean column), model, schedule, microbatches, dp, pp)
CASES = {
    "mlp-1rank": (1, "single", SMALL, "1f1b", 4, 1, 1),
    "mlp-dp2": (2, "dp", SMALL, "1f1b", 4, 2, 1),
    "mlp-pp2-naive": (2, "naive", SMALL, "naive", 1, 1, 2),
    "mlp-pp2-gpipe": (2, "gpipe", SMALL, "gpipe", 4, 1, 2),
    "mlp-pp2-1f1b": (2, "1f1b", SMALL, "1f1b", 4, 1, 2),
    # the same pipelines with mpipar's balanced stages (parallel.layout = "auto": the first,
    # 784-wide layer alone on rank 0) instead of the uniform split (four layers on rank 0)
    "mlp-pp2-naive-auto": (2, "naive", SMALL, "naive", 1, 1, 2),
    "mlp-pp2-gpipe-auto": (2, "gpipe", SMALL, "gpipe", 4, 1, 2),
    "mlp-pp2-1f1b-auto": (2, "1f1b", SMALL, "1f1b", 4, 1, 2),
    "wide-1rank": (1, "single", WIDE, "1f1b", 4, 1, 1),
    "wide-dp2": (2, "dp", WIDE, "1f1b", 4, 2, 1),
    "wide-pp2-gpipe": (2, "gpipe", WIDE, "gpipe", 4, 1, 2),
    "wide-pp2-1f1b": (2, "1f1b", WIDE, "1f1b", 4, 1, 2),
    "gpt-pp2": (2, None, "gpt", "1f1b", 4, 1, 2),
    "gpt-dp2": (2, None, "gpt", "1f1b", 4, 2, 1),
}
# one thread per rank on both sides: BLAS, and mpipar's own kernel threads (by default a rank's
# share of the cores: two for a one-rank case on two cores, which the lean loop does not have)
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MPIPAR_KERNEL_THREADS": "1"}


# -- the worker: one mpipar run under mpiexec (imports only mpipar: no mpi4py here)
def mpipar_config(case, steps):
    from mpipar.config import load_config

    ranks, _, model, sched, m, dp, pp = CASES[case]
    over = {"parallel.dp": dp, "parallel.pp": pp, "parallel.schedule": sched,
            "parallel.microbatches": m, "run.trace": False, "run.progress": False,
            "train.steps": steps, "train.eval_interval": 0}
    if case.endswith("-auto"):
        over["parallel.layout"] = "auto"
    if model == "gpt":
        return load_config(str(ROOT / "experiments" / "configs" / "tiny.toml"), over)
    over.update({"model.kind": "mlp", "model.sizes": str(list(model)),
                 "model.activation": "relu", "model.task": "classification",
                 "model.init_std": 0.05, "train.dtype": "float32", "train.batch_size": 128,
                 "train.lr": 0.01, "train.optimizer": "sgd", "train.momentum": 0.0,
                 "train.weight_decay": 0.0, "train.warmup_steps": 0, "train.grad_clip": 0.0})
    return load_config(None, over)


def worker(args):
    from mpipar.backend import Backend
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer
    from mpipar.training.loop import prepare_data

    cfg = mpipar_config(args.case, args.warmup + args.steps)
    backend = Backend("cpu", cfg.train.dtype)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, 1, backend=backend)
    data = prepare_data(cfg, grid) if cfg.model.kind == "gpt" else None
    tr = Trainer(cfg, grid, Tracer(enabled=args.trace), backend, data)
    for _ in range(args.warmup):
        tr.train_step()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    grid.world_comm.barrier()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    gc_before = [g["collections"] for g in gc.get_stats()]
    for _ in range(args.steps):
        out = tr.train_step()
    if prof:
        prof.disable()
    gc_runs = [g["collections"] - b for g, b in zip(gc.get_stats(), gc_before)]
    grid.world_comm.barrier()
    elapsed = time.perf_counter() - t0
    if prof:
        write_counts(prof, Path(f"{args.profile}.rank{grid.rank}.txt"), args.steps,
                     actions=len(tr.executor.actions))
        prof.dump_stats(f"{args.profile}.rank{grid.rank}.prof")  # for pstats / snakeviz
    if grid.rank == 0:
        print(json.dumps({"impl": "mpipar", "case": args.case, "steps": args.steps,
                          "seconds": elapsed, "gc_collections": gc_runs,
                          "samples_per_s": cfg.train.batch_size * args.steps / elapsed,
                          "loss": out["loss"]}), flush=True)


# where a call is counted: the first pattern found in its file's path (a built-in or NumPy
# call counts where its caller is)
AREAS = (("math", ("/nn/", "numpy", "lean.py", "backend.py")),
         ("pipeline", ("/pipeline/", "/p2p.py", "/requests.py", "progress.py")),
         ("grad sync", ("/parallel/data.py", "/shm", "/algorithms.py", "/nonblocking.py",
                        "/collectives.py", "/windows.py", "/staging.py")),
         ("step", ("/training/", "/trace.py")))


def _area(filename: str) -> str:
    return next((name for name, keys in AREAS if any(k in filename for k in keys)), "other")


def _areas(stats) -> dict:
    """Calls per area: a function's own calls go to its file's area; a built-in's to its
    callers' areas, in proportion to their calls."""
    out = {}
    for (f, _, _), (_, nc, _, _, callers) in stats.items():
        if f != "~":
            out[_area(f)] = out.get(_area(f), 0) + nc
            continue
        for (cf, _, _), (_, cnc, *_r) in callers.items():
            out[_area(cf)] = out.get(_area(cf), 0) + cnc
    return out


def write_counts(prof, path, steps, actions=0):
    """Calls per step of every function, most called first; the total and the calls per area
    (``AREAS``) first. ``prof``: a ``cProfile.Profile`` or the path of its dump."""
    import pstats

    stats = pstats.Stats(str(prof) if isinstance(prof, Path) else prof).stats
    rows = sorted(((nc / steps, f"{Path(f).name}:{line} {fn}")
                   for (f, line, fn), (_, nc, *_rest) in stats.items()), reverse=True)
    total = sum(n for n, _ in rows)
    areas = ", ".join(f"{k} {v / steps:.0f}" for k, v in sorted(_areas(stats).items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        per_action = f", {actions} actions: {total / actions:.0f} per action" if actions else ""
        fh.write(f"{total:.0f} calls per step ({steps} steps profiled{per_action})\n")
        fh.write(f"by area: {areas}\n")
        for n, name in rows:
            fh.write(f"{n:10.2f}  {name}\n")


# -- the driver
def steps_of(case, args) -> int:
    """Timed steps of one run: ``--steps`` for the small MLP, a fifth of it for the wide one
    (each step is ~40x the work), ``--gpt-steps`` for the GPT."""
    model = CASES[case][2]
    if model == "gpt":
        return args.gpt_steps
    return max(1, args.steps // 5) if model == WIDE else args.steps


def run_once(impl, case, args, path):
    ranks, layout, model, *_ = CASES[case]
    if impl == "lean":
        cmd = [sys.executable, str(LEAN), "--layout", layout, "--sizes",
               ",".join(map(str, model)), "--steps", str(steps_of(case, args)), "--warmup", "5",
               "--microbatches", str(CASES[case][4]), "--split", lean_split(case),
               "--data-rows", str(args.lean_data_rows)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case,
               "--steps", str(steps_of(case, args)), "--warmup", "5"]
    env = {**os.environ, **THREADS, "PYTHONPATH": str(path)}
    res = subprocess.run(["mpiexec", "-n", str(ranks), *cmd], capture_output=True, text=True,
                         env=env, timeout=args.timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        sys.exit(f"{impl} {case} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(lines[-1])["samples_per_s"]


def lean_split(case):
    """The lean pipeline's stage boundaries: mpipar's own partition of the same model."""
    from mpipar.training.resolved import resolve

    if CASES[case][6] == 1:
        return ""
    bounds = resolve(mpipar_config(case, 10)).bounds
    return ",".join(str(bounds[c][0]) for c in sorted(bounds)) + f",{len(CASES[case][2]) - 1}"


def bench(args):
    cases = args.cases.split(",") if args.cases else list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    impls = {"mpipar": Path(args.checkout or ROOT).resolve()}
    if args.baseline:
        impls["baseline"] = Path(args.baseline).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    steady = steadiness_lines(args, "before the runs")
    same = [] if args.separate else [c for c in cases if CASES[c][1]]
    text = same_job(same, args, impls, out) if same else ""
    rest = [c for c in cases if c not in same]
    if rest:
        text += separate(rest, args, impls, out)
    took = time.perf_counter() - t_start
    text = steady + text + steadiness_lines(args, "after the runs")
    text += f"\n{took:.0f} s in all\n"
    print(text)
    (out / "results.md").write_text(text)


def steadiness_lines(args, when: str) -> str:
    """The machine's steadiness (mpipar/plan/steadiness.py) sampled now, as text for the
    table: how far one block pair or one run here can be trusted ("" with --steadiness 0)."""
    seconds = args.steadiness if args.steadiness is not None else (0.5 if args.quick else 10.0)
    if seconds == 0:
        return ""
    from mpipar.plan import steadiness

    return steadiness.report(steadiness.measured(seconds), when) + "\n"


def same_job(cases, args, impls, out):
    """The lean loop and mpipar in one job per case, alternating blocks (lean_samejob.py)."""
    import lean_samejob

    results, rows = lean_samejob.bench(
        cases, args, impls, lambda c: block_of(c, args), lean_split, {**os.environ, **THREADS})
    write_h5(out / "lean_bench_samejob.h5",
             {c: {f"{prefix}{n}/{k}": v for r, jobs in enumerate(rounds)
                  for prefix in [f"round{r}/" if len(rounds) > 1 else ""]
                  for n, t in jobs.items() for k, v in t.items()}
              for c, rounds in results.items()}, args, impls)
    note = (f"; {args.rounds} rounds, the order of the checkouts' jobs alternating: medians "
            "over the rounds, the IQR column the range of their ratios"
            if args.rounds > 1 else "")
    return (lean_samejob.HEAD + "\n" + "\n".join(rows) + f"\n\nsame job: per case "
            f"{args.block_pairs} alternating block pairs after a warm-up block each, "
            f"{args.block} steps per block ({max(1, args.block // 5)} for the 1024-wide MLP); "
            f"ratios: median (IQR) of the per-pair ratios; {lean_data(args)}{note}\n\n")


def block_of(case, args):
    """Steps per same-job block: a fifth for the 1024-wide MLP (each step is ~40x the work)."""
    return max(1, args.block // 5) if CASES[case][2] == WIDE else args.block


def lean_data(args):
    return (f"lean data: each step's rows drawn from {args.lean_data_rows}"
            if args.lean_data_rows else "lean data: 4 fixed batches")


def separate(cases, args, impls, out):
    """Each implementation its own job, in interleaved pairs of jobs."""
    results, t_start = {}, time.perf_counter()
    for case in cases:
        names = (["lean"] if CASES[case][1] else []) + list(impls)
        runs = {n: [] for n in names}
        for k in range(args.pairs):
            order = names if k % 2 == 0 else names[::-1]
            for n in order:
                runs[n].append(run_once(n, case, args, impls.get(n, ROOT)))
        results[case] = runs
        print(row(case, runs), flush=True)
    took = time.perf_counter() - t_start
    write_h5(out / "lean_bench.h5", results, args, impls)
    return (table(results) + f"\n\nseparate jobs: {args.pairs} interleaved pairs per case, "
            f"{took:.0f} s; {lean_data(args)}\n")


def _ratio(runs, a, b):
    return statistics.median(x / y for x, y in zip(runs[a], runs[b]))


def row(case, runs):
    med = {n: statistics.median(v) for n, v in runs.items()}
    cells = [f"{med.get(n, float('nan')):,.0f}" if n in med else "-"
             for n in ("lean", "mpipar", "baseline")]
    ratios = [f"{_ratio(runs, 'mpipar', b):.2f}" if b in runs else "-"
              for b in ("lean", "baseline")]
    return f"| {case} | " + " | ".join(cells + ratios) + " |"


def table(results):
    head = ("| case | lean samples/s | mpipar samples/s | baseline samples/s | mpipar / lean | "
            "mpipar / baseline |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(row(c, r) for c, r in results.items())


def write_h5(path, results, args, impls):
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        f.attrs["pairs"] = args.pairs
        f.attrs["steps"] = args.steps
        f.attrs["lean_data_rows"] = args.lean_data_rows
        f.attrs["impls"] = json.dumps({k: str(v) for k, v in impls.items()})
        for case, runs in results.items():
            g = f.create_group(case)
            for n, v in runs.items():
                g.create_dataset(n, data=np.asarray(v, dtype=np.float64))


def profile(args):
    """Call counts per step (cProfile) of mpipar, and of the lean loop where the case has one."""
    out = Path(args.out) / "profile"
    cases = args.cases.split(",") if args.cases else [
        "mlp-1rank", "mlp-dp2", "mlp-pp2-naive", "mlp-pp2-gpipe", "mlp-pp2-1f1b", "gpt-pp2",
        "gpt-dp2"]
    for case in cases:
        ranks, layout, model, *_ = CASES[case]
        if layout:
            prefix = out / f"{case}.lean"
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(LEAN), "--layout", layout, "--sizes",
                   ",".join(map(str, model)), "--steps", "20", "--warmup", "3",
                   "--microbatches", str(CASES[case][4]), "--split", lean_split(case),
                   "--profile", str(prefix)]
            subprocess.run(["mpiexec", "-n", str(ranks), *cmd], check=True, capture_output=True,
                           env={**os.environ, **THREADS}, timeout=args.timeout)
            for r in range(ranks):
                dump = Path(f"{prefix}.rank{r}.prof")
                write_counts(dump, Path(f"{prefix}.rank{r}.txt"), 20)
                first = Path(f"{prefix}.rank{r}.txt").read_text().splitlines()[0]
                print(f"{case} lean rank {r}: {first}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case,
               "--steps", "20", "--warmup", "3", "--profile", str(out / case)]
        if args.trace:
            cmd.append("--trace")
        env = {**os.environ, **THREADS,
               "PYTHONPATH": str(Path(args.checkout or ROOT).resolve())}
        res = subprocess.run(["mpiexec", "-n", str(ranks), *cmd], capture_output=True,
                             text=True, env=env, timeout=args.timeout)
        if res.returncode != 0:
            sys.exit(f"{case} failed:\n{res.stderr[-2000:]}")
        for r in range(ranks):
            first = (out / f"{case}.rank{r}.txt").read_text().splitlines()[0]
            print(f"{case} rank {r}: {first}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="experiments/lean_bench.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="timed steps per MLP run")
    p.add_argument("--gpt-steps", type=int, default=30, help="timed steps per GPT run")
    p.add_argument("--cases", default="", help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--checkout", default="", help="the mpipar checkout to time (default: this)")
    p.add_argument("--baseline", default="", help="a second checkout, timed alongside")
    p.add_argument("--out", default=str(ROOT / "runs" / "experiments" / "lean_bench"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--lean-data-rows", type=int, default=0,
                   help="the lean loop draws each step's rows from a set of this many, as "
                        "mpipar does (3686: the MLP's training rows); 0: 4 fixed batches")
    p.add_argument("--separate", action="store_true",
                   help="each implementation its own job, alternating (the default: one job "
                        "per case running both in alternating blocks; GPT cases always separate)")
    p.add_argument("--block", type=int, default=20,
                   help="same job: steps per block (a fifth for the 1024-wide MLP)")
    p.add_argument("--block-pairs", type=int, default=20, help="same job: timed block pairs")
    p.add_argument("--rounds", type=int, default=1,
                   help="same job: run every case this many times, the order of --baseline's "
                        "two jobs alternating from round to round")
    p.add_argument("--quick", action="store_true",
                   help="1 pair of 10 steps, or 3 block pairs of 2 steps: a smoke test")
    p.add_argument("--steadiness", type=float, default=None, metavar="SECONDS",
                   help="the machine's steadiness sampled this long before the runs and after "
                        "them (mpipar/plan/steadiness.py; default 10, --quick 0.5, 0: none)")
    p.add_argument("--profile", nargs="?", const=True, default=False,
                   help="cProfile call counts per step instead of timings")
    p.add_argument("--trace", action="store_true", help="worker/profile: tracing on")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default="", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if args.case not in CASES:
            sys.exit(f"--case {args.case!r}: choose from {', '.join(CASES)}")
        return worker(args)
    if str(ROOT) not in sys.path:  # the driver's own imports (lean_split) from this checkout
        sys.path.insert(0, str(ROOT))
    if args.quick:
        args.pairs, args.steps, args.gpt_steps = 1, 10, 3
        args.block_pairs, args.block = 3, 2
    if min(args.pairs, args.steps, args.block, args.block_pairs, args.rounds) < 1:
        sys.exit("--pairs, --steps, --block, --block-pairs and --rounds must each be >= 1")
    if args.steadiness is not None and not args.steadiness >= 0:
        sys.exit(f"--steadiness {args.steadiness}: give seconds >= 0 (0: none)")
    if args.profile:
        return profile(args)
    return bench(args)


if __name__ == "__main__":
    main()
