"""What this rank is doing now, for the watchdog (``mpipar.mpi.job.watchdog``).

A leaf module: the executor, the trainer and the loop call ``beat(what)`` before each piece of
work that may block (a schedule action, a gradient all-reduce, a checkpoint write). A beat costs
one clock read and two stores; ``what`` is formatted only if the watchdog fires.
"""

from __future__ import annotations

import time


class Progress:
    __slots__ = ("last", "what", "step", "peer_of")

    def __init__(self):
        self.last = time.monotonic()
        self.what: object = "start-up"
        self.step = -1
        # what -> the world rank (and host) that ``what`` waits for, or None; set by the loop
        self.peer_of = None


state = Progress()


def beat(what) -> None:
    """This rank starts ``what`` now (any object; ``str`` of it names the operation)."""
    state.last = time.monotonic()
    state.what = what


def begin_step(step: int) -> None:
    state.step = step
    beat("the set-up of the step (its batch, before the first action)")
