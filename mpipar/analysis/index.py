"""Each rank's events grouped by step once, so that selecting steps costs what they hold.

Analysis asks for "the events of rank r in these steps" many times (per step, per replica, per
fitted quantity). A mask over all of a rank's events each time (``np.isin(ev["step"], steps)``)
made the calibrated prediction cost steps x events. Here one stable sort by step per rank
(``np.argsort``), kept with the array it indexes, turns every later selection into
``searchsorted`` slices: linear in the events overall.

The index lives in ``Run.cache`` keyed by the array's ``id`` and holds the array itself, so the
id cannot be reused while the entry lives; ``dataclasses.replace`` (``predict.replicas``) shares
the cache, so sub-runs reuse the parents' index for the arrays they share. Arrays are treated as
read-only once indexed (code that edits events works on copies: ``predict_continuous``).
"""

from __future__ import annotations

import numpy as np

from . import kinds


class StepIndex:
    """The events of one rank, ordered by step (recording order kept within a step)."""

    __slots__ = ("events", "order", "steps", "uniq", "lo", "hi")

    def __init__(self, events: np.ndarray):
        self.events = events
        self.order = np.argsort(events["step"], kind="stable")
        self.steps = events["step"][self.order]
        self.uniq, first = np.unique(self.steps, return_index=True)
        self.lo = first
        self.hi = np.append(first[1:], len(self.steps)).astype(first.dtype)

    def positions(self, steps) -> np.ndarray:
        """Indices into ``events`` of the events of ``steps``, in recording order."""
        steps = np.unique(np.asarray(steps, dtype=np.int64))  # each step once, in order
        n = self.uniq.size
        if not steps.size or not n:
            return np.empty(0, dtype=np.intp)
        at = np.searchsorted(self.uniq, steps)
        at = at[(at < n) & (self.uniq[np.minimum(at, n - 1)] == steps)]
        if not at.size:
            return np.empty(0, dtype=np.intp)
        if at.size == 1:
            return self.order[self.lo[at[0]]:self.hi[at[0]]]
        if at[-1] - at[0] + 1 == at.size:  # a run of consecutive steps: one slice
            idx = self.order[self.lo[at[0]]:self.hi[at[-1]]]
        else:
            idx = np.concatenate([self.order[self.lo[i]:self.hi[i]] for i in at])
        return np.sort(idx)  # recording order across steps, as a mask would give

    def select(self, steps) -> np.ndarray:
        """The events of ``steps`` (a step number or a collection), in recording order; their
        kind codes taken from the whole array's when it has them (``kinds.codes_of``)."""
        at = self.positions(steps)
        if at.size == len(self.events):  # every event (in recording order): the array itself
            return self.events
        got = self.events[at]
        whole = kinds.known(self.events)
        if whole is not None:
            kinds.remember(got, whole[at])
        return got


def step_index(run, rank: int) -> StepIndex:
    """The (cached) ``StepIndex`` of ``run.events[rank]``."""
    ev = run.events[rank]
    cache = run.cache
    got = cache.get(id(ev))
    if got is None or got.events is not ev:
        got = cache[id(ev)] = StepIndex(ev)
    return got


# in ``Run.cache``: True where one rank's pieces are made at once (``stream``): several ask for
# the same steps, so the last selection of each array is kept (a whole run's cache does not
# set it: a copy of every rank's events would double what the run holds)
KEEP_LAST = "index.keep_last_selection"


def events_in(run, rank: int, steps) -> np.ndarray:
    """Rank ``rank``'s events in ``steps``, in recording order; the same rows as
    ``ev[np.isin(ev["step"], steps)]`` at the cost of those rows."""
    ev = run.events[rank]
    if not len(ev):
        return ev
    if not run.cache.get(KEEP_LAST):
        return step_index(run, rank).select(steps)
    want = np.unique(np.asarray(steps, dtype=np.int64))
    last = run.cache.get((id(ev), "selection"))
    if last is not None and last[0] is ev and np.array_equal(last[1], want):
        return last[2]
    got = step_index(run, rank).select(want)
    run.cache[(id(ev), "selection")] = (ev, want, got)
    return got


def ranks_with_events(run) -> list[int]:
    """World ranks whose event array is not empty (``predict.replicas`` empties the others)."""
    return [r for r, ev in enumerate(run.events) if len(ev)]


def all_events_in(run, steps) -> np.ndarray:
    """Every rank's events of ``steps``, rank after rank (as concatenate-then-mask gave)."""
    if not run.events:
        return np.empty(0)
    # the ranks without events add nothing: a replica's sub-run skips the other replicas' ranks
    got = [events_in(run, r, steps) for r in ranks_with_events(run)]
    return np.concatenate(got) if got else run.events[0][:0]
