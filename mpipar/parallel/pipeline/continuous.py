"""Running an asynchronous schedule: weight versions, and continuous runs across steps.

``VersionStash`` is PipeDream's weight stashing generalised to the version map of
``versions.weight_versions``: F(mb, c) runs with its version's weights (the current ones, or an
older copy the rank kept: vertical sync, PipeDream-2BW's older buffer) and BW(mb, c) with the same
ones. A version is copied once, when a forward first needs it or an UPDATE ends it while a
later forward still needs it, and kept while a later forward or an in-flight backward needs
it, so 2BW holds two buffers: the current weights and one older copy.

``ContinuousRun`` runs a continuous schedule (``Schedule.steps`` > 1) one step at a time:
step k's call runs this rank's actions up to the last one of a micro-batch of step k (the
forwards of later steps' micro-batches that 1F1B starts early included), keeping every
activation, gradient, posted receive and stash between calls. ``fetch(step)`` hands over that
step's micro-batches when a forward first needs them: the trainer feeds step k+1 while step k's
micro-batches are still in flight.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from .actions import ScheduleError
from .versions import weight_versions


class VersionStash:
    """Weight versions of this rank's chunks (module doc). ``older``: {chunk: arrays} of version
    -1 (2BW's older buffer carried in); ``zero_each``: zero the gradients before each backward
    (PipeDream: one update per micro-batch) or let them accumulate (2BW: one per step)."""

    def __init__(self, schedule, chunks: dict, older=None, zero_each=True):
        self.map = {k: v for k, v in weight_versions(schedule).items() if k[1] in chunks}
        self.uses = Counter((c, v) for (_, c), v in self.map.items())
        self.current = dict.fromkeys(chunks, 0)  # chunk -> UPDATEs done on it
        self.kept = {(c, -1): w for c, w in (older or {}).items() if c in chunks}
        self.saved = {}  # (mb, chunk) -> the arrays its backward runs with
        self.zero_each = zero_each

    def _weights(self, c, v, chunk):
        if (c, v) not in self.kept:
            if v != self.current[c]:
                raise ScheduleError(f"F of chunk {c} needs weight version {v}, which this rank "
                                    f"no longer holds or has not made (it is at "
                                    f"{self.current[c]})")
            self.kept[(c, v)] = [p.data.copy() for p in chunk.params()]
        return self.kept[(c, v)]

    @contextmanager
    def forward(self, mb, c, chunk):
        """F(mb, c) with its version's weights; stashes them for its backward."""
        v = self.map[(mb, c)]
        w = self._weights(c, v, chunk)
        self.saved[(mb, c)] = w
        self.uses[(c, v)] -= 1
        if not self.uses[(c, v)]:
            del self.kept[(c, v)]  # the stash holds it until the backward
        if v == self.current[c]:  # the current weights are the version: no swap
            yield
            return
        with _swapped(chunk.params(), w, zero=False):
            yield

    @contextmanager
    def swapped(self, mb, c, chunk):
        """BW(mb, c) with the weights F(mb, c) ran with."""
        with _swapped(chunk.params(), self.saved.pop((mb, c)), zero=self.zero_each):
            yield

    def updating(self, c, chunk):
        """Before an UPDATE of chunk c: keep a copy of the version it ends if a later forward
        needs it (2BW: the next step's forwards on the last stages; vertical sync)."""
        v = self.current[c]
        if self.uses[(c, v)] > 0 and (c, v) not in self.kept:
            self.kept[(c, v)] = [p.data.copy() for p in chunk.params()]
        self.current[c] = v + 1


@contextmanager
def _swapped(params, weights, zero):
    current = [p.data for p in params]
    for p, w in zip(params, weights):
        p.data = w
        if zero:
            p.zero_grad()
    try:
        yield
    finally:
        for p, w in zip(params, current):
            p.data = w


class _Lazy:
    """st.inputs / st.targets of a continuous run: micro-batch j of the lists is micro-batch
    j % m of step j // m, fetched (``fetch(step) -> (xs, ys)``) when first needed."""

    def __init__(self, fetch, m, which):
        self.fetch, self.m, self.which = fetch, m, which

    def __getitem__(self, mb):
        return self.fetch(mb // self.m)[self.which][mb % self.m]


def step_cuts(schedule, actions) -> list[int]:
    """For each step k, the index in ``actions`` just after the last action of a micro-batch
    of step k or earlier: step k's call runs the actions up to there."""
    last = [0] * schedule.steps
    for i, a in enumerate(actions):
        last[schedule.step_of(a.mb)] = i + 1
    for k in range(1, schedule.steps):  # a step with no action of its own on this rank
        last[k] = max(last[k], last[k - 1])
    return last


class ContinuousRun:
    """One continuous schedule on this rank, run a step at a time (module doc)."""

    def __init__(self, executor, fetch, older=None):
        from .executor import StepState

        s = executor.schedule
        self.executor, self.schedule, self.m = executor, s, s.microbatches
        self.cuts = step_cuts(s, executor.actions)
        self.next_step, self.pos = 0, 0
        scale = 1.0 / s.microbatches if s.kind == "pipedream-2bw" else 1.0
        x0 = fetch(0)[0][0]
        self.st = StepState(_Lazy(fetch, self.m, 0), _Lazy(fetch, self.m, 1), False, scale,
                            executor._receives(x0))
        self.st.stash = VersionStash(s, executor.chunks, older,
                                     zero_each=s.kind != "pipedream-2bw")

    @property
    def done(self) -> bool:
        return self.next_step >= self.schedule.steps

    def run_step(self) -> dict:
        """Run the next step's share of the actions; returns {micro-batch of that step: loss}
        on the rank with the last chunk: the step's loss is the mean over its own micro-batches,
        whose forwards and backwards all end in this call (1F1B: a step's backwards are done
        before the next step's begin on the rank holding the loss)."""
        k = self.next_step
        ex, st = self.executor, self.st
        tracer = ex.tracer
        base = tracer.step if tracer is not None else 0
        for a in ex.actions[self.pos:self.cuts[k]]:
            if tracer is not None:  # events carry the step of their micro-batch
                tracer.step = base + self.schedule.step_of(a.mb) - k
            ex.dispatch(a, st)
        if tracer is not None:
            tracer.step = base
        self.pos, self.next_step = self.cuts[k], k + 1
        if self.done:
            ex.finish(st)
        lo = k * self.m
        return {mb - lo: st.losses.pop(mb) for mb in range(lo, lo + self.m) if mb in st.losses}
