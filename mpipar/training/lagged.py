"""Lagged metric reductions: a continuous (no-flush) run never meets itself once per step.

A flushing step ends in one world all-reduce of the loss (and gradient norm) and one of the
stop signal; in a pipeline kept full across steps that reduction is a per-step meeting, where
the stage that ran ahead waits for the last one. ``LaggedReductions`` instead posts step k's
numbers (loss share, one count per stop signal) as a non-blocking all-reduce and reads them
``LAG`` steps later, or at once when the pipeline drains (evaluation, checkpoint, the end).

Stop bound: a stop is still honoured only at a drain point (the preemption checkpoint needs one
weight version per stage), and every reduction is read there, so a signal received before step
k's reduction stops the run at the first drain point at or after k, as with a per-step
agreement; in between, the ranks learn of it at most ``LAG`` steps after it was posted.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..progress import beat

LAG = 2  # steps between posting a step's reduction and reading it


class LaggedReductions:
    """The reductions posted and not yet read, oldest first, over ``comm`` (the world)."""

    def __init__(self, comm, lag: int = LAG):
        self.comm, self.lag = comm, lag
        self.posted = deque()  # (step, buffer, request or None on a world of one rank)
        self.records = {}  # step -> its record, waiting for its reduction

    def post(self, step: int, values) -> None:
        buf = np.array(values, dtype=np.float64)
        req = self.comm.iallreduce(buf, op="sum") if self.comm.size > 1 else None
        self.posted.append((step, buf, req))

    def ready(self, drain: bool) -> list:
        """[(step, reduced values)] now due: those ``lag`` steps old, or all when draining."""
        out = []
        while self.posted and (drain or len(self.posted) > self.lag):
            step, buf, req = self.posted.popleft()
            if req is not None:
                beat("the lagged loss all-reduce")
                req.wait()
            out.append((step, buf))
        return out
