"""Preemption: SIGTERM or SIGUSR1 (Slurm's ``--signal=USR1@90`` before the time limit, or
``scancel --signal=USR1``) asks the run to stop cleanly after the current step.

The launcher delivers the signal to each rank at a slightly different time, so a rank must
not act on it alone: once per step every rank contributes its flag to one all-reduce (the
step's own reduction of the loss and gradient norm, ``shares`` / ``agree_from``, or
``failfast.world_max``) and all stop after the same step, then write a checkpoint, flush the
dump and exit with ``failfast.EXIT_PREEMPTED``.

When: ``mpipar train`` installs the handlers before ``MPI_Init`` and again right after it
(MPICH's own ``MPI_Init`` installs a SIGUSR1 handler, so a handler installed only before it
would be replaced and a Slurm warning arriving during a slow start lost); a signal received
during the start is honoured after the first step. They stay installed until the preemption
checkpoint and the dump are on disk: a real preemption often sends TERM twice (or TERM, then
KILL after a grace period), and the grace period must be spent writing the checkpoint, so a
repeated signal is logged and ignored. Handlers live in the main thread only.
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """``with StopSignals() as s: ... s.agree()`` (collective over the world, once per step).

    Nested uses share the outermost one: the handlers ``mpipar train`` installed right after
    ``MPI_Init`` (and the signal they may already have received) carry into the step loop."""

    active: StopSignals | None = None

    def __init__(self):
        self.received = 0
        self.stopping = False  # the ranks agreed to stop: the checkpoint is being written
        self._previous = {}
        self._owner = False

    def _handler(self, signum, frame):
        if self.received or self.stopping:  # a stop is under way: its checkpoint must be written
            if _rank() in ("0", "?"):  # one line per job, not one per rank
                _say(f"mpipar: signal {int(signum)} again: ignored while the run stops "
                     f"with a checkpoint\n")
            return
        self.received = int(signum)

    def __enter__(self):
        if StopSignals.active is not None:
            return StopSignals.active
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
            StopSignals.active, self._owner = self, True
        return self

    def reinstall(self) -> None:
        """Put the handlers back after ``MPI_Init``, which replaces MPICH's SIGUSR1 handler
        (a signal received before keeps its flag)."""
        if self._owner:
            for s in STOP_SIGNALS:
                signal.signal(s, self._handler)

    def __exit__(self, *exc):
        if self._owner:
            for s, h in self._previous.items():
                signal.signal(s, h)
            StopSignals.active, self._owner = None, False
        return False

    def agree(self) -> int:
        """The signal number every rank stops on (the largest any rank received), or 0."""
        from ..mpi import world_max

        signum = world_max(self.received)
        self.stopping = self.stopping or bool(signum)
        return signum

    def shares(self) -> list:
        """This rank's part of a summed agreement: one count per stop signal (a lagged
        reduction carries it with the loss; ``agree_from`` reads the sums)."""
        return [float(self.received == s) for s in STOP_SIGNALS]

    def agree_from(self, counts) -> int:
        """``agree``'s answer from the summed ``shares`` of every rank."""
        signum = max((int(s) for s, n in zip(STOP_SIGNALS, counts) if n > 0), default=0)
        self.stopping = self.stopping or bool(signum)
        return signum


def _rank() -> str:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var]
    return "?"


def _say(text: str) -> None:
    """os.write, not print: a handler may run while the main thread is inside a print."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass
