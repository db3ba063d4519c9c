"""The ``mpipar`` command: one subcommand per module under ``mpipar.commands``.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so ``mpipar analyze`` never imports MPI.
"""

from __future__ import annotations

import argparse
import importlib
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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpipar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    args = parser.parse_args(argv)
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
