"""One module per ``mpipar`` subcommand (see mpipar/cli.py)."""
