"""Running a continuous schedule (``Schedule.steps`` > 1) one step at a time.

``ContinuousRun``: step k's call runs this rank's actions up to the last one of a micro-batch
of step k (``actions.step_cuts``; the forwards of later steps' micro-batches that 1F1B starts
early included), keeping every activation, gradient, posted receive and weight version
(``stash.VersionStash``, lazy: the version in a chunk's parameters stays there between
actions and calls, the current weights back at the drain) between calls. ``fetch(step)``
hands over that step's micro-batches when a forward first needs them: the trainer feeds step
k+1 while step k's micro-batches are still in flight; ``run_step(k)`` reads steps k and k + 1
before its first action (the call may start step k + 1's forwards), so a batch read is never
timed as a forward or a loss.
"""

from __future__ import annotations

from .actions import step_cuts
from .executor import StepState
from .stash import VersionStash


class _Lazy:
    """st.inputs / st.targets of a continuous run: micro-batch j of the lists is micro-batch
    j % m of step j // m, fetched (``fetch(step) -> (xs, ys)``) when first needed."""

    def __init__(self, fetch, m, which):
        self.fetch, self.m, self.which = fetch, m, which

    def __getitem__(self, mb):
        return self.fetch(mb // self.m)[self.which][mb % self.m]


class ContinuousRun:
    """One continuous schedule on this rank, run a step at a time (module doc)."""

    def __init__(self, executor, fetch, older=None, zero=True):
        s = executor.schedule
        self.executor, self.schedule, self.m = executor, s, s.microbatches
        # only the ranks with the first chunk (inputs) or the last (targets) read batches
        self.fetch = fetch if {0, executor.last} & set(executor.chunks) else None
        self.cuts = step_cuts(s, executor.actions)
        self.stretches = _stretches(s, executor.actions, self.cuts)
        self.next_step, self.pos = 0, 0
        scale = 1.0 / s.microbatches if s.kind == "pipedream-2bw" else 1.0
        x0 = fetch(0)[0][0]
        self.st = StepState(_Lazy(fetch, self.m, 0), _Lazy(fetch, self.m, 1), False, scale,
                            executor._receives(x0))
        # lazy: a version stays in the parameters across actions (2BW: a few swaps per step)
        self.st.stash = VersionStash(s, executor.chunks, older,
                                     zero_each=s.kind != "pipedream-2bw" and zero, lazy=True)

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
        for j in (k, k + 1):  # read before the actions, so no F or LOSS region times a read
            if self.fetch is not None and j < self.schedule.steps:
                self.fetch(j)
        tracer = ex.tracer
        if tracer is None:
            ex.run_range(self.pos, self.cuts[k], st)
        else:
            base = tracer.step
            for lo, hi, ahead in self.stretches[k]:  # events carry the step of their micro-batch
                tracer.step = base + ahead
                ex.run_range(lo, hi, st)
            tracer.step = base
        self.pos, self.next_step = self.cuts[k], k + 1
        if self.done:
            ex.finish(st)
            st.stash.home()  # the drain reads the current weights (evaluation, checkpoints)
        lo = k * self.m
        return {mb - lo: st.losses.pop(mb) for mb in range(lo, lo + self.m) if mb in st.losses}


def _stretches(schedule, actions, cuts) -> list:
    """Per step k: [(lo, hi, ahead)]: the runs of call k's actions (``cuts``) whose
    micro-batches belong to one step, k + ahead (worked out once, not per action)."""
    out, lo = [], 0
    for k, hi in enumerate(cuts):
        runs = []
        for i in range(lo, hi):
            ahead = schedule.step_of(actions[i].mb) - k
            if runs and runs[-1][2] == ahead:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, ahead])
        out.append([tuple(r) for r in runs])
        lo = hi
    return out
