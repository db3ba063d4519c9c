"""The same-job mode of experiments/lean_bench.py: the lean loop and mpipar in one ``mpiexec``.

The machine's speed drifts by tens of percent within seconds to minutes, so two implementations
timed in separate jobs, one after the other, are compared across different machine states. Here
every rank builds both, for the same case (layout, stage split, data mode), and the two run in
short alternating blocks: a warm-up block of each, then ``pairs`` block pairs of ``block`` steps
each, the order alternating from pair to pair (lean first in even pairs). All ranks meet at a
barrier before each block; a block's time is the slowest rank's, found by one reduction after
the block, outside the timing. A slow moment of the machine then hits both sides of a pair, and
the per-pair ratio is a fair comparison; their median and interquartile range are reported.

The lean loop (``mpipar/mpi/bench/lean.py``) is loaded by file path from this checkout, so it is
the same program whatever mpipar ``PYTHONPATH`` points at, and gets its own duplicate of the
world communicator (its messages never meet mpipar's). Run by lean_bench.py as::

    mpiexec -n R python experiments/lean_samejob.py --case C --split S --block K --pairs P
        [--data-rows N]

Rank 0 prints one JSON line: the case and each block's seconds, per implementation, in order.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEAN = HERE.parent / "mpipar" / "mpi" / "bench" / "lean.py"


def load_lean():
    """lean.py as a module of its own, from this checkout (its ``phase_clock`` import falls back
    to a plain import from its folder)."""
    sys.path.insert(0, str(LEAN.parent))
    try:
        spec = importlib.util.spec_from_file_location("lean_reference", LEAN)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(LEAN.parent))
    return mod


def build(args, lean=None):
    """(grid, mpipar trainer, lean loop, lean's batch of a step, lr) for ``args.case``
    (``lean``: the lean module, loaded here unless given)."""
    sys.path.insert(0, str(HERE))
    import numpy as np
    from lean_bench import CASES, mpipar_config

    from mpipar.backend import Backend
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer

    _, layout, sizes, _, m, *_ = CASES[args.case]
    total = 2 * (args.pairs + 1) * args.block
    cfg = mpipar_config(args.case, total)
    backend = Backend("cpu", cfg.train.dtype)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, 1, backend=backend)
    trainer = Trainer(cfg, grid, Tracer(enabled=False), backend, None)
    lean = lean or load_lean()
    dtype = np.dtype(cfg.train.dtype)
    split = [int(s) for s in args.split.split(",")] if args.split else None
    loop = lean.Lean(lean.world_comm(), layout, lean.init_params(sizes, 0, 0.05, dtype),
                     m, split=split)
    opts = types.SimpleNamespace(data_rows=args.data_rows, batch=cfg.train.batch_size)
    batch = lean.batches(np.random.default_rng(1), opts, sizes, dtype, take=loop.take)
    return grid, trainer, loop, batch, cfg.train.lr


def worker(args):
    grid, trainer, loop, batch, lr = build(args)
    step_no = {"lean": 0}

    def lean_block():
        for _ in range(args.block):
            loop.step(*batch(step_no["lean"]), lr, taken=True)
            step_no["lean"] += 1

    def mpipar_block():
        for _ in range(args.block):
            trainer.train_step()

    blocks = {"lean": lean_block, "mpipar": mpipar_block}
    times = {"lean": [], "mpipar": []}
    world, barrier = grid.world_comm, loop.comm.Barrier

    def timed(name):
        barrier()
        t0 = time.perf_counter()
        blocks[name]()
        dt = time.perf_counter() - t0
        return world.allreduce_scalar(dt, "max")  # the slowest rank: the block's wall time

    for name in blocks:  # warm-up: caches, buffer pools, the first allocations
        timed(name)
    for k in range(args.pairs):
        for name in (("lean", "mpipar") if k % 2 == 0 else ("mpipar", "lean")):
            times[name].append(timed(name))
    if grid.rank == 0:
        print(json.dumps({"case": args.case, "block": args.block, "times": times}), flush=True)


# -- the driver's side: what one job's block times say
def summary(times, block, batch):
    """{"lean", "mpipar": median samples/s; "ratio": median of the per-pair ratios mpipar/lean;
    "q1", "q3": their quartiles} from one job's block times (seconds)."""
    ratios = sorted(a / b for a, b in zip(times["lean"], times["mpipar"]))  # time ratio: speed
    q1, _, q3 = (statistics.quantiles(ratios, n=4, method="inclusive")
                 if len(ratios) > 1 else ratios * 3)
    return {**{n: statistics.median(block * batch / t for t in v) for n, v in times.items()},
            "ratio": statistics.median(ratios), "q1": q1, "q3": q3, "pairs": len(ratios)}


def run_job(case, split, args, path, block, env):
    """One same-job run of ``case`` with the mpipar at ``path``: its block times."""
    import subprocess

    from lean_bench import CASES

    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--split", split,
           "--block", str(block), "--pairs", str(args.block_pairs),
           "--data-rows", str(args.lean_data_rows)]
    res = subprocess.run(["mpiexec", "-n", str(CASES[case][0]), *cmd], capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(path)}, timeout=args.timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        sys.exit(f"same-job {case} ({path}) failed (exit {res.returncode}):\n"
                 f"{res.stderr[-2000:]}")
    return json.loads(lines[-1])["times"]


def bench(cases, args, impls, block_of, split_of, env):
    """Every case's same-job runs: {case: [{impl: block times} per round]} and the table's
    rows. With a baseline checkout, each case runs one job per checkout, both measured against
    the same lean loop, and mpipar / baseline is the ratio of their two median ratios to it.
    The two jobs run one after the other, and which goes first alone can move a case by a few
    per cent (BENCHMARKS.md, "Ninth cuts"): the order alternates from case to case and from
    round to round (``--rounds``), so an even number of rounds puts each checkout first
    equally often."""
    results, rows = {c: [] for c in cases}, []
    for r in range(max(1, args.rounds)):
        for i, case in enumerate(cases):
            names = list(impls) if (i + r) % 2 == 0 else list(impls)[::-1]
            results[case].append({n: run_job(case, split_of(case), args, impls[n],
                                             block_of(case), env) for n in names})
    for case in cases:
        rows.append(row(case, results[case], block_of(case)))
        print(rows[-1], flush=True)
    return results, rows


def row(case, rounds, block, batch=128):
    """One case's table row from its rounds: a round's own numbers, or with several the median
    over the rounds of each (the IQR column then the range of the rounds' ratios)."""
    per = [{n: summary(t, block, batch) for n, t in jobs.items()} for jobs in rounds]
    med = statistics.median
    me = {k: med(s["mpipar"][k] for s in per) for k in ("lean", "mpipar", "ratio")}
    if len(per) == 1:
        spread = f"{per[0]['mpipar']['q1']:.3f}-{per[0]['mpipar']['q3']:.3f}"
    else:
        ratios = [s["mpipar"]["ratio"] for s in per]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    base = "baseline" in per[0]
    cells = [f"{me['lean']:,.0f}", f"{me['mpipar']:,.0f}", f"{me['ratio']:.3f}", spread,
             f"{med(s['baseline']['ratio'] for s in per):.3f}" if base else "-",
             f"{med(s['mpipar']['ratio'] / s['baseline']['ratio'] for s in per):.3f}"
             if base else "-"]
    return f"| {case} | " + " | ".join(cells) + " |"


HEAD = ("| case | lean samples/s | mpipar samples/s | mpipar / lean | IQR | baseline / lean | "
        "mpipar / baseline |\n|---|---|---|---|---|---|---|")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", required=True)
    p.add_argument("--split", default="")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--pairs", type=int, default=20, help="timed block pairs")
    p.add_argument("--data-rows", type=int, default=0)
    args = p.parse_args(argv)
    if args.block < 1 or args.pairs < 1:
        sys.exit(f"--block {args.block} --pairs {args.pairs}: both must be >= 1")
    worker(args)


if __name__ == "__main__":
    main()
