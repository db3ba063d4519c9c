"""An emulated cluster on one machine: nodes as Linux namespaces joined by shaped links.

No MPI here: subprocess calls to ip, tc, unshare and nsenter. `mpipar cluster up|down|status|
exec|mpiexec` is the command; `nodes.up/down`, `nodes.enter_argv` and `counters.read` are what
tests and experiments use.
"""
