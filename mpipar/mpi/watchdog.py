"""The watchdog: end the job when this rank makes no progress for ``run.watchdog_s`` seconds.

A daemon thread per rank reads ``mpipar.progress`` (the last beat and what it was) once in a
while. A rank stuck in a receive, a collective or a kernel stops beating; after the limit it
reports itself and what it is blocked in, and aborts the job through ``failfast`` (exit
``EXIT_STALLED``). The first step may be slower (warm-up, first allocations): it gets
``FIRST_STEP_FACTOR`` times the limit.
"""

from __future__ import annotations

import threading
import time

from .. import progress
from . import failfast

FIRST_STEP_FACTOR = 3


class Watchdog:
    def __init__(self, limit_s: float, first_step: int = 0):
        self.limit_s = float(limit_s)
        self.first_step = first_step
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> Watchdog:
        if self.limit_s > 0:
            progress.beat("start of the training loop")
            self._thread = threading.Thread(target=self._run, name="mpipar-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def limit(self) -> float:
        first = progress.state.step <= self.first_step
        return self.limit_s * (FIRST_STEP_FACTOR if first else 1)

    def _run(self) -> None:
        poll = min(1.0, self.limit_s / 10)
        while not self._stop.wait(poll):
            s = progress.state
            idle = time.monotonic() - s.last
            if idle > self.limit() and not self._stop.is_set():
                failfast.fail(f"no progress for {idle:.0f} s (run.watchdog_s = {self.limit_s:g}),"
                              f" blocked in {s.what} (step {s.step}); another rank may have "
                              "stopped first, see its message", code=failfast.EXIT_STALLED)
