"""Preemption: SIGTERM or SIGUSR1 (Slurm's ``--signal=USR1@90`` before the time limit, or
``scancel --signal=USR1``) asks the run to stop cleanly after the current step.

The launcher delivers the signal to each rank at a slightly different time, so a rank must
not act on it alone: once per step every rank contributes its flag to one all-reduce
(``failfast.world_max``) and all stop after the same step, then write a checkpoint, flush the
dump and exit with ``failfast.EXIT_PREEMPTED``. The handlers are installed only while the steps
run (before that the default action ends the process and the launcher ends the job) and only
in the main thread.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """``with StopSignals() as s: ... s.agree()`` (collective over the world, once per step)."""

    def __init__(self):
        self.received = 0
        self._previous = {}

    def _handler(self, signum, frame):
        self.received = self.received or int(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        return False

    def agree(self) -> int:
        """The signal number every rank stops on (the largest any rank received), or 0."""
        from ..mpi import world_max

        return world_max(self.received)
