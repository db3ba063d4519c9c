"""``PhaseClock``: CPU time per phase of a training step, for the lean loop (``lean.py``) and
mpipar side by side (experiments/lean_phases.py). Plain Python and NumPy: ``lean.py`` imports it
when run by file path too."""

from __future__ import annotations

import json
import time

import numpy as np


class PhaseClock:
    """CPU time (``time.process_time``: this process, all its threads) per phase of a step,
    each phase exclusive of the phases called inside it. ``patch(owner, name, phase)`` wraps
    ``owner.name`` (a class's method, a module's function, an instance's attribute); a call
    made with no phase around it is the step itself: its own time is ``step``, and its end
    closes the step's record (``steps``: one {phase: seconds} per step). CPU time, not wall
    time: far less sensitive to other processes on the machine (an MPI wait that spins is CPU
    time too). experiments/lean_phases.py prints the table of mpipar against this loop."""

    ROOT = "step"

    def __init__(self):
        self.steps = []
        self._acc = {}
        self._stack = []  # per open call: [seconds spent in phases called inside it]
        self.overhead = 0.0
        self.overhead = self._calibrate()

    def _calibrate(self, calls=500, repeats=5) -> float:
        """The CPU seconds a timed call adds to its caller's phase (the wrapper's own work
        outside its clock reads): subtracted from the caller, so a phase that makes many timed
        calls (mpipar's dispatch between actions) is not charged for the clock."""
        inner = self.wrap(lambda: None, "calibration")

        def outer():
            for _ in range(calls):
                inner()
        runs = []
        for _ in range(repeats):
            self.wrap(outer, self.ROOT)()
            runs.append(self.steps.pop()[self.ROOT] / calls)
        return float(np.median(runs))

    def wrap(self, fn, phase):
        clock, stack, acc = time.process_time, self._stack, self._acc

        def timed(*args, **kwargs):
            inner = [0.0]
            stack.append(inner)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                stack.pop()
                name = phase if stack else self.ROOT
                acc[name] = acc.get(name, 0.0) + dt - inner[0]
                if stack:
                    stack[-1][0] += dt + self.overhead
                else:
                    self.steps.append(dict(acc))
                    acc.clear()
        return timed

    def patch(self, owner, name, phase):
        setattr(owner, name, self.wrap(getattr(owner, name), phase))

    def medians(self) -> dict:
        """{phase: median seconds per step} over the recorded steps (0 where a step had none),
        and ``total``: the median step."""
        phases = sorted({k for s in self.steps for k in s})
        out = {k: float(np.median([s.get(k, 0.0) for s in self.steps])) for k in phases}
        out["total"] = float(np.median([sum(s.values()) for s in self.steps]))
        return out

    def dump(self, prefix, rank, **info):
        """``medians()`` to PREFIX.rankR.json (a file per rank: ranks' prints can interleave)."""
        with open(f"{prefix}.rank{rank}.json", "w") as fh:
            json.dump({**info, "rank": rank, "phases": self.medians()}, fh)
