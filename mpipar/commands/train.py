"""mpipar train: train the GPT or MLP on one rank or any dp x pp x tp grid."""

from __future__ import annotations

import sys

HELP = "train a model (one rank, or any dp x pp x tp grid under mpiexec/srun)"

# short flag -> config field
SHORT = {
    "steps": "train.steps", "dtype": "train.dtype", "seed": "train.seed", "device": "train.device",
    "batch_size": "train.batch_size", "seq_len": "train.seq_len", "lr": "train.lr",
    "out": "run.out", "data": "data.path", "resume": "run.resume",
    "dp": "parallel.dp", "pp": "parallel.pp", "tp": "parallel.tp",
    "schedule": "parallel.schedule", "microbatches": "parallel.microbatches",
    "virtual_stages": "parallel.virtual_stages", "schedule_file": "parallel.schedule_file",
    "layout": "parallel.layout",
}
FLAGS = {"recompute": "parallel.recompute", "sequence_parallel": "parallel.sequence_parallel",
         "zero1": "parallel.zero1", "no_trace": "run.trace", "quiet": "run.progress"}


def add_arguments(p):
    p.add_argument("--config", help="TOML config (see experiments/configs/)")
    for name, field in SHORT.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       help=f"= --set {field}=VALUE")
    for name, field in FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true",
                       help=f"sets {field}" + (" = false" if name in ("no_trace", "quiet") else ""))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set train.lr=1e-3 (repeatable)")


def overrides_from(args) -> dict:
    over = {}
    for name, field in SHORT.items():
        v = getattr(args, name)
        if v is not None:
            over[field] = v
    for name, field in FLAGS.items():
        if getattr(args, name):
            over[field] = "false" if name in ("no_trace", "quiet") else "true"
    for item in args.set:
        if "=" not in item:
            from mpipar.config import ConfigError

            raise ConfigError(f"--set {item!r} must look like section.key=value")
        k, v = item.split("=", 1)
        over[k.strip()] = v.strip()
    return over


def run(args) -> int:
    from mpipar.checkpoint import CheckpointError
    from mpipar.config import ConfigError, load_config
    from mpipar.datasets import DataError

    try:
        cfg = load_config(args.config, overrides_from(args))
        from mpipar.training import run as train_run

        train_run(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as exc:
        # the same bad input fails the same way on every rank, before any MPI traffic
        print(f"mpipar train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
