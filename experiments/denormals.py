"""Subnormal optimizer state: what it costs a long run, and what flushing it to zero changes.

usage: python experiments/denormals.py [--config experiments/configs/mlp.toml] [--steps 3000]
           [--every 500] [--set key=value ...] [--out DIR]

A moment whose gradient stays zero (a dead ReLU unit, an embedding row no batch reads) decays
geometrically through the subnormal floats before it reaches zero, and x86 float arithmetic
takes a microcode assist per subnormal element. ``optim.flush_subnormals`` zeroes them every
``optim.FLUSH_EVERY`` steps. This trains two copies of one model on one rank, in one process,
step by step in turn (so a slow moment of the machine hits both): one as the optimizer does it,
one with the flush switched off. Every ``--every`` steps it prints, for each, the median
microseconds of the optimizer's step and of the whole training step over the steps since the
last row, and how many optimizer-state values are subnormal; and whether the two copies' losses
and weights are still the same bits (the flush should change no update). Writes
``OUT/results.{csv,json,md}`` (``OUT`` = ``runs/experiments/denormals``). One BLAS thread. Run
it alone on the machine: about a minute for the default 3,000 steps of ``mlp.toml``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MPIPAR_KERNEL_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import ROOT, machine_note, out_dir, parser, write_results  # noqa: E402

COLUMNS = ["step", "opt_us_flush", "opt_us_off", "step_us_flush", "step_us_off",
           "subnormal_flush", "subnormal_off", "same_bits"]


def make_trainer(config: str, sets: dict, steps: int):
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer
    from mpipar.training.loop import prepare_data

    over = {"run.trace": False, "run.progress": False, "train.eval_interval": 0,
            "train.steps": steps, **sets}
    cfg = load_config(config, over)
    backend = Backend("cpu", cfg.train.dtype)
    grid = ProcessGrid(1, 1, 1, backend=backend)
    data = prepare_data(cfg, grid) if cfg.model.kind == "gpt" else None
    return Trainer(cfg, grid, Tracer(enabled=False), backend, data)


def timed_optimizer(trainer, flush: bool) -> list:
    """Wraps the trainer's optimizer step to record its seconds; ``flush=False`` switches the
    flush of subnormals off for this optimizer only."""
    opt, times = trainer.opt, []
    step = opt.step
    if not flush:
        opt._flushes = lambda: False

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        step(*args, **kwargs)
        times.append(time.perf_counter() - t0)

    opt.step = timed
    return times


def subnormals(trainer) -> int:
    """Optimizer-state values below the smallest normal number, not zero."""
    n = 0
    for buffers in trainer.opt.state.values():
        for a in buffers.values():
            tiny = np.finfo(a.dtype).tiny
            n += int(np.count_nonzero((a != 0) & (np.abs(a) < tiny)))
    return n


def same_bits(a, b) -> bool:
    return all(np.array_equal(p.data, q.data) for p, q in zip(a.params, b.params))


def main(argv=None) -> int:
    p = parser("denormals", __doc__)
    p.add_argument("--config", default=str(ROOT / "experiments" / "configs" / "mlp.toml"))
    p.add_argument("--every", type=int, default=500, help="steps between rows (default 500)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both copies (repeatable)")
    args = p.parse_args(argv)
    if args.every < 1 or (args.steps is not None and args.steps < 1):
        p.error("--every and --steps must be at least 1")
    bad = [kv for kv in args.set if "=" not in kv]
    if bad:
        p.error(f"--set takes KEY=VALUE (e.g. --set train.optimizer=sgd), got {bad}")
    steps = args.steps or (200 if args.quick else 3000)
    every = min(args.every, steps) if not args.quick else 50
    sets = dict(kv.split("=", 1) for kv in args.set)
    out = out_dir(args, "denormals")
    trainers = {"flush": make_trainer(args.config, sets, steps),
                "off": make_trainer(args.config, sets, steps)}
    opt_times = {k: timed_optimizer(t, k == "flush") for k, t in trainers.items()}
    step_times = {k: [] for k in trainers}
    losses_equal = True
    rows = []
    for s in range(1, steps + 1):
        order = ("flush", "off") if s % 2 else ("off", "flush")  # alternate who goes first
        loss = {}
        for k in order:
            t0 = time.perf_counter()
            loss[k] = trainers[k].train_step()["loss"]
            step_times[k].append(time.perf_counter() - t0)
        losses_equal &= loss["flush"] == loss["off"]
        if s % every == 0 or s == steps:
            row = {"step": s, "same_bits": bool(losses_equal and same_bits(*trainers.values()))}
            for k, t in trainers.items():
                row[f"opt_us_{k}"] = 1e6 * statistics.median(opt_times[k])
                row[f"step_us_{k}"] = 1e6 * statistics.median(step_times[k])
                row[f"subnormal_{k}"] = subnormals(t)
                opt_times[k].clear()
                step_times[k].clear()
            rows.append(row)
            print(row, flush=True)
    meta = {"config": args.config, "sets": sets, "steps": steps, **machine_note()}
    write_results(out, "subnormal optimizer state, flushed against not", rows, COLUMNS, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
