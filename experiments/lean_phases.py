"""Where a small model's step spends its CPU time: mpipar against the lean loop, phase by phase.

Each run times every step's phases with ``PhaseClock`` (mpipar/mpi/bench/phase_clock.py):
``time.process_time`` around the data draw, the forward, the loss, the backward, the
point-to-point messages, the gradient sync, the gradient zeroing, the norm, the step's world
all-reduce and the optimizer, each exclusive of the phases called inside it; ``dispatch`` is the
executor's own time between actions (mpipar only), ``step`` the rest of the step (bookkeeping).
CPU time rather than wall time: another process on the machine slows a run's wall clock far more
than its CPU time, so the table holds up under some load (an MPI wait that spins is CPU time
too: at dp = 2 ``grad sync`` includes waiting for the other rank).

By default both run in one ``mpiexec`` per case, as ``lean_bench.py`` times them
(``lean_samejob.py``): every rank builds the lean loop and mpipar's trainer, one clock times
both, and they run in alternating blocks (20 steps each, ``--pairs`` block pairs after a warm-up
block of each, the order alternating, the ranks at a barrier before each block), so both sides
of the table are measured in the same machine state. A phase's number is its median over the
steps of all blocks, in CPU microseconds per step. ``--separate`` runs each implementation as
its own ``mpiexec`` instead, in interleaved pairs (``--repeats``), 200 timed steps after 5
warm-up steps, the table the median over the repeats: two separate runs see different machine
states, so their phases differ by a few hundred microseconds from run to run.

    python experiments/lean_phases.py                        # mlp-1rank and mlp-dp2, ~30 s
    python experiments/lean_phases.py --cases mlp-pp2-gpipe  # any MLP case of lean_bench
    python experiments/lean_phases.py --cases wide-1rank --block 4 --pairs 10  # ~10 s
    python experiments/lean_phases.py --lean-data-rows 3686  # the lean loop draws its rows too
    python experiments/lean_phases.py --separate             # one mpiexec per implementation
    python experiments/lean_phases.py --checkout DIR         # the mpipar of another checkout
    python experiments/lean_phases.py --quick                # a smoke test

The lean loop's default data are 4 fixed batches that stay in cache (its ``data`` is then a list
index); ``--lean-data-rows 3686`` draws each step's rows as mpipar does. Writes
``OUT/phases.md`` (``OUT`` = ``runs/experiments/lean_phases``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lean_bench import CASES, LEAN, ROOT, THREADS, lean_split, mpipar_config

PHASES = ("data", "forward", "loss", "backward", "p2p", "grad sync", "zero grads", "norm",
          "step reduce", "optimizer", "dispatch", "step")


# -- the worker: one mpipar run under mpiexec
def instrument(clock):
    """Wrap mpipar's step phases (before the trainer is made: the executor binds its handlers
    and the gradient sync's callbacks at construction)."""
    from mpipar.parallel.data import GradSync
    from mpipar.parallel.pipeline.executor import PipelineExecutor
    from mpipar.training import Trainer

    clock.patch(Trainer, "local_batch", "data")
    clock.patch(Trainer, "norm_and_loss", "step reduce")  # less the norm inside it
    clock.patch(Trainer, "norm_sq_local", "norm")
    for name, phase in (("run", "dispatch"), ("_forward", "forward"), ("_loss", "loss"),
                        ("_backward", "backward"), ("_weight", "backward"), ("_send", "p2p"),
                        ("_receive", "p2p"), ("finish", "p2p")):
        clock.patch(PipelineExecutor, name, phase)
    for name in ("start", "unit_ready", "chunk_ready", "finish"):
        clock.patch(GradSync, name, "grad sync")
    clock.patch(GradSync, "zero_grads", "zero grads")


def worker(args):
    from mpipar.backend import Backend
    from mpipar.mpi import ProcessGrid
    from mpipar.mpi.bench.phase_clock import PhaseClock
    from mpipar.trace import Tracer
    from mpipar.training import Trainer

    cfg = mpipar_config(args.case, args.warmup + args.steps)
    backend = Backend("cpu", cfg.train.dtype)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, 1, backend=backend)
    clock = PhaseClock()
    instrument(clock)
    tr = Trainer(cfg, grid, Tracer(enabled=False), backend)
    clock.patch(tr.opt, "step", "optimizer")
    step = clock.wrap(tr.train_step, "step")
    for _ in range(args.warmup):
        step()
    clock.steps.clear()
    grid.world_comm.barrier()
    for _ in range(args.steps):
        step()
    grid.world_comm.barrier()
    clock.dump(args.dump, grid.rank, impl="mpipar", case=args.case, steps=args.steps)


def same_job_worker(args):
    """Both implementations in this job, one clock, alternating blocks (see the module doc):
    per rank a JSON file of each one's phase medians."""
    import lean_samejob

    from mpipar.mpi.bench.phase_clock import PhaseClock

    lean = lean_samejob.load_lean()
    clock = PhaseClock()
    lean.lean_phases(clock, lean)  # both patched before anything is built
    instrument(clock)
    grid, trainer, loop, batch, lr = lean_samejob.build(args, lean)
    clock.patch(trainer.opt, "step", "optimizer")
    draw = clock.wrap(batch, "data")
    steps = {"lean": clock.wrap(lambda k: loop.step(*draw(k), lr, taken=True), "step"),
             "mpipar": clock.wrap(lambda k: trainer.train_step(), "step")}
    done = {"lean": 0, "mpipar": 0}
    kept = {"lean": [], "mpipar": []}

    def block(name, keep=True):
        grid.world_comm.barrier()
        clock.steps.clear()
        for _ in range(args.block):
            steps[name](done[name])
            done[name] += 1
        if keep:
            kept[name].extend(clock.steps)

    block("lean", False)
    block("mpipar", False)
    for k in range(args.pairs):
        for name in (("lean", "mpipar") if k % 2 == 0 else ("mpipar", "lean")):
            block(name)
    for name, recorded in kept.items():
        clock.steps = recorded
        clock.dump(f"{args.dump}.{name}", grid.rank, impl=name, case=args.case,
                   steps=len(recorded))


# -- the driver
def mpipar_path(args) -> str:
    """Where the timed mpipar is imported from: ``--checkout DIR``, else this checkout (the
    lean loop and these scripts always come from this one)."""
    return str(Path(args.checkout or ROOT).resolve())


def run_same_job(case, args) -> dict:
    """{impl: {rank: {phase: median seconds per step}}} of one same-job run."""
    ranks = CASES[case][0]
    dump = Path(args.out) / "runs" / f"{case}.samejob"
    dump.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case,
           "--split", lean_split(case), "--block", str(args.block), "--pairs", str(args.pairs),
           "--data-rows", str(args.lean_data_rows), "--dump", str(dump)]
    env = {**os.environ, **THREADS, "PYTHONPATH": mpipar_path(args)}
    res = subprocess.run(["mpiexec", "-n", str(ranks), *cmd], capture_output=True, text=True,
                         env=env, timeout=args.timeout)
    if res.returncode != 0:
        sys.exit(f"same-job {case} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return {impl: {r: json.loads(Path(f"{dump}.{impl}.rank{r}.json").read_text())["phases"]
                   for r in range(ranks)} for impl in ("lean", "mpipar")}


def run_once(impl, case, args) -> dict:
    """{rank: {phase: median seconds per step}} of one run."""
    ranks, layout, model, *_ = CASES[case]
    dump = Path(args.out) / "runs" / f"{case}.{impl}"
    dump.parent.mkdir(parents=True, exist_ok=True)
    if impl == "lean":
        cmd = [sys.executable, str(LEAN), "--phases", str(dump), "--layout", layout, "--sizes",
               ",".join(map(str, model)), "--steps", str(args.steps), "--warmup", "5",
               "--microbatches", str(CASES[case][4]), "--split", lean_split(case),
               "--data-rows", str(args.lean_data_rows)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--separate",
               "--case", case, "--steps", str(args.steps), "--warmup", "5", "--dump", str(dump)]
    env = {**os.environ, **THREADS,
           "PYTHONPATH": mpipar_path(args) if impl == "mpipar" else str(ROOT)}
    res = subprocess.run(["mpiexec", "-n", str(ranks), *cmd], capture_output=True, text=True,
                         env=env, timeout=args.timeout)
    if res.returncode != 0:
        sys.exit(f"{impl} {case} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return {r: json.loads(Path(f"{dump}.rank{r}.json").read_text())["phases"]
            for r in range(ranks)}


def table(case, runs, how) -> str:
    """Per rank: phase | lean us | mpipar us | mpipar - lean, medians over the repeats."""
    ranks = sorted(runs["lean"][0])
    head = "| phase | " + " | ".join(f"lean r{r} | mpipar r{r} | diff r{r}" for r in ranks)
    lines = [f"{case} (CPU us per step, {how})",
             "", head + " |", "|---" * (1 + 3 * len(ranks)) + "|"]
    for phase in (*PHASES, "total"):
        cells = []
        for r in ranks:
            med = {n: statistics.median(run[r].get(phase, 0.0) for run in runs[n]) * 1e6
                   for n in ("lean", "mpipar")}
            cells += [f"{med['lean']:,.0f}", f"{med['mpipar']:,.0f}",
                      f"{med['mpipar'] - med['lean']:+,.0f}"]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drive(args):
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in CASES or CASES[c][1] is None]
    if bad:
        sys.exit(f"--cases {bad}: choose MLP cases of lean_bench: "
                 f"{', '.join(c for c in CASES if CASES[c][1] is not None)}")
    t0, out = time.perf_counter(), []
    for case in cases:
        if args.separate:
            runs = {"lean": [], "mpipar": []}
            for k in range(args.repeats):
                for impl in (("lean", "mpipar") if k % 2 == 0 else ("mpipar", "lean")):
                    runs[impl].append(run_once(impl, case, args))
            how = f"median over steps, then over {args.repeats} separate runs each"
        else:
            runs = {impl: [ranks] for impl, ranks in run_same_job(case, args).items()}
            how = f"one job: median over the steps of {args.pairs} alternating block pairs"
        out.append(table(case, runs, how))
        print(out[-1] + "\n", flush=True)
    data = (f"lean data: each step's rows drawn from {args.lean_data_rows}"
            if args.lean_data_rows else "lean data: 4 fixed batches")
    mode = (f"{args.repeats} interleaved pairs of separate runs, {args.steps} steps each"
            if args.separate else
            f"same job, {args.pairs} block pairs of {args.block} steps")
    timed = f"; mpipar of {mpipar_path(args)}" if args.checkout else ""
    tail = f"{mode}, {time.perf_counter() - t0:.0f} s; {data}{timed}"
    print(tail)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "phases.md").write_text("\n\n".join(out) + f"\n\n{tail}\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="experiments/lean_phases.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="mlp-1rank,mlp-dp2")
    p.add_argument("--separate", action="store_true",
                   help="each implementation its own mpiexec (--repeats pairs of --steps)")
    p.add_argument("--pairs", type=int, default=15, help="same job: timed block pairs")
    p.add_argument("--block", type=int, default=20, help="same job: steps per block")
    p.add_argument("--repeats", type=int, default=3, help="--separate: interleaved pairs")
    p.add_argument("--steps", type=int, default=200, help="--separate: timed steps per run")
    p.add_argument("--lean-data-rows", type=int, default=0,
                   help="the lean loop draws each step's rows from a set of this many "
                        "(3686: the MLP's training rows); 0: 4 fixed batches")
    p.add_argument("--checkout", default="",
                   help="time the mpipar of this checkout (default: this one)")
    p.add_argument("--out", default=str(ROOT / "runs" / "experiments" / "lean_phases"))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--quick", action="store_true", help="1 repeat, 20 steps: a smoke test")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default="", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--dump", default="", help=argparse.SUPPRESS)
    p.add_argument("--split", default="", help=argparse.SUPPRESS)
    p.add_argument("--data-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args) if args.separate else same_job_worker(args)
    if str(ROOT) not in sys.path:  # lean_split imports mpipar from this checkout
        sys.path.insert(0, str(ROOT))
    if args.quick:
        args.repeats, args.steps, args.pairs, args.block = 1, 20, 2, 3
    return drive(args)


if __name__ == "__main__":
    main()
