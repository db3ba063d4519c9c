"""The ``mpipar`` command: one subcommand per module under ``mpipar.commands``.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so ``mpipar analyze`` never imports MPI.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand name -> module under mpipar.commands
COMMANDS = {
    "train": "train",
    "prepare-data": "prepare_data",
    "schedule": "schedule",
    "commbench": "commbench",
    "analyze": "analyze",
    "slurm": "slurm",
    "bench": "bench",
    "plan": "plan",
    "cluster": "cluster",
}


def _load(name: str):
    return importlib.import_module(f"mpipar.commands.{COMMANDS[name]}")


def launcher_rank() -> str | None:
    """This process's rank as the launcher set it (before MPI starts), or None alone."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var]
    return None


class Parser(argparse.ArgumentParser):
    """Under mpiexec / srun every rank parses the same command line: a usage error (or
    --help) is printed by rank 0 alone, once per job; every rank exits with status 2."""

    def _print_message(self, message, file=None):
        if launcher_rank() in (None, "0"):
            super()._print_message(message, file)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="mpipar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}  # name -> its parser (a usage error names the command's usage)
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help="")  # placeholder so the name is listed
            continue
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("mpipar.commands"):
                continue  # command not built yet
            raise
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        parser.commands[name] = p
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .threads import kernel_threads_setting, set_blas_threads

    set_blas_threads()  # before anything imports NumPy
    try:
        kernel_threads_setting()
    except ValueError as e:  # every rank says it and stops, before any MPI traffic
        print(f"mpipar: error: {e}", file=sys.stderr)
        return 2
    # Load only the module of the chosen command (fast start, no MPI import for analysis).
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only=chosen)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's usage, not mpipar's
        parser.commands.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if not args.command:
        parser.print_help()
        return 2
    try:
        rc = int(_load(args.command).run(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left shows up here, not at exit
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return rc


# the exit status of a process killed by SIGPIPE, as `git log | head` ends
EXIT_BROKEN_PIPE = 128 + 13


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``mpipar schedule ... | head``): stop quietly. Point
    stdout at /dev/null so the interpreter's own flush at exit raises nothing either."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
