"""mpipar train: train the GPT or MLP on one rank or any dp x pp x tp grid."""

from __future__ import annotations

HELP = "train a model (one rank, or any dp x pp x tp grid under mpiexec/srun)"

# short flag -> config field
SHORT = {
    "steps": "train.steps", "dtype": "train.dtype", "seed": "train.seed", "device": "train.device",
    "batch_size": "train.batch_size", "seq_len": "train.seq_len", "lr": "train.lr",
    "out": "run.out", "data": "data.path", "resume": "run.resume",
    "dp": "parallel.dp", "pp": "parallel.pp", "tp": "parallel.tp",
    "tp_mode": "parallel.tp_mode", "tp_depth": "parallel.tp_depth",
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


def handled_errors() -> tuple:
    """Errors with a message meant for the user (printed alone, exit 2): bad input, missing or
    corrupt files, an unwritable run directory. Anything else is a bug: traceback, exit 1."""
    from mpipar.checkpoint import CheckpointError
    from mpipar.config import ConfigError
    from mpipar.datasets import DataError

    return (ConfigError, DataError, CheckpointError, OSError)


def run(args) -> int:
    """Exit codes: 0 done, 2 bad input (before training) or a handled error on a rank, 1 a bug,
    75 preempted (SIGTERM/SIGUSR1: checkpoint written, resume with --resume auto), 124 the
    watchdog (no progress for run.watchdog_s), n for sys.exit(n) on a rank (failfast.EXIT_*)."""
    from mpipar.mpi import failfast, world_size_and_rank
    from mpipar.training.signals import StopSignals

    brief = handled_errors()
    failfast.install(brief)
    with StopSignals() as signals:  # a preemption signal during the start: stop after step 1
        world_size_and_rank()  # MPI_Init, which installs MPICH's own SIGUSR1 handler
        signals.reinstall()
        return _run(args, brief)


def _run(args, brief) -> int:
    from mpipar.mpi import failfast, world_size_and_rank

    # Start: the deterministic checks, on every rank, before any MPI traffic. The ranks then
    # agree: one message (not one per rank), the same exit code everywhere, no rank left waiting.
    error = cfg = resolved = None
    try:
        world_size, _ = world_size_and_rank()
        from mpipar.config import load_config
        from mpipar.training import preflight
        from mpipar.training.loop import check_run_settings

        cfg = load_config(args.config, overrides_from(args))
        resolved = preflight(cfg, world_size)
        check_run_settings(cfg)
    except Exception as exc:
        error = exc
    code = failfast.agree_on_start(error, prefix="mpipar train: error: ")
    if code:
        return code
    # After the start any failure on any rank aborts the whole job (failfast.guard).
    from mpipar.training.loop import Preempted, StartFailed
    from mpipar.training.loop import run as train_run

    with failfast.guard(brief):
        try:
            train_run(cfg, resolved)
        except Preempted:
            return failfast.EXIT_PREEMPTED
        except StartFailed as exc:  # said once already, the same code on every rank
            return exc.code
    return 0
