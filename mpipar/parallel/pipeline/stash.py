"""Weight versions of an asynchronous schedule on one rank (PipeDream's weight stashing).

``VersionStash`` generalises weight stashing to the version map of ``versions.weight_versions``:
F(mb, c) runs with its version's weights (the current ones, or an older copy the rank kept:
vertical sync, PipeDream-2BW's older buffer) and BW(mb, c) with the same ones. A version is
copied once, when a forward first needs it or an UPDATE ends it while a later forward still
needs it, and kept while a later forward or an in-flight backward needs it, so 2BW holds two
buffers: the current weights and one older copy.

A forward whose backward comes before the chunk's next UPDATE on its rank (``live``: the last
stage of 1F1B, where F(mb), BW(mb) and UPDATE(mb) follow one another) needs no copy: its
backward finds the same weights in place. Only the copies an UPDATE would overwrite are made.

``lazy`` (a continuous run): a version put in a chunk's parameters stays there until an action
needs another one, instead of the current weights coming back after every forward and backward.
2BW runs most of a step's forwards and backwards on the older buffer, so it swaps a few times
per step instead of before and after each action (``binds`` counts the swaps); an UPDATE, and
the drain (``home``), put the current weights back. A forward on the current version takes a
stashed copy of it where that is what is in place (the same values). The swap is made before
the forward, in ``keep`` (timed as STASH with the copies, ``copies``), not inside it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext

from ...nn.flat import PackedCopier
from .actions import ScheduleError
from .versions import weight_versions

_IN_PLACE = nullcontext()  # (reusable: it holds nothing)


class VersionStash:
    """Weight versions of this rank's chunks (module doc). ``older``: {chunk: arrays} of version
    -1 (2BW's older buffer carried in); ``zero_each``: zero the gradients before each backward
    (PipeDream: one update per micro-batch) or let them accumulate (2BW: one per step); a
    callable ``zero_each(chunk)`` zeroes them its own way (the trainer: one fill per gradient
    bucket instead of one per parameter). ``lazy``: versions stay in place between actions
    (module doc); ``cleaned(c)`` says an UPDATE left chunk c's gradients zero (the optimizer
    zeroes them while they are in cache), so its next backward needs no zeroing of its own."""

    def __init__(self, schedule, chunks: dict, older=None, zero_each=True, lazy=False):
        self.map = {k: v for k, v in weight_versions(schedule).items() if k[1] in chunks}
        self.uses = Counter((c, v) for (_, c), v in self.map.items())
        self.current = dict.fromkeys(chunks, 0)  # chunk -> UPDATEs done on it
        self.kept = {(c, -1): w for c, w in (older or {}).items() if c in chunks}
        self.saved = {}  # (mb, chunk) -> the arrays its backward runs with
        self.zero = zero_each if callable(zero_each) else self._zero if zero_each else None
        # each chunk's parameters, listed once: a swap per action walked the layers each time
        self.params = {c: ch.params() for c, ch in chunks.items()}
        self.live = _live(schedule, chunks, self.map)
        # a version's copy: one per packed run of the weights (the optimizer packs them)
        self._copiers = {c: PackedCopier() for c in chunks}
        self.lazy = lazy
        # lazy: chunk -> (the stashed arrays in its parameters, the current weights' arrays)
        self.away = {}
        self.binds = 0  # swaps of a chunk's parameters (to a version or back)
        self.clean = set()  # chunks whose gradients an UPDATE zeroed since their last backward

    def _weights(self, c, v, chunk):
        if (c, v) not in self.kept:
            if v != self.current[c]:
                raise ScheduleError(f"F of chunk {c} needs weight version {v}, which this rank "
                                    f"no longer holds or has not made (it is at "
                                    f"{self.current[c]})")
            self.kept[(c, v)] = self._copy(c)
        return self.kept[(c, v)]

    def _copy(self, c) -> list:
        return self._copiers[c].copy(self._home(c))

    def _home(self, c) -> list:
        """The current weights' arrays of chunk c, wherever its parameters point now."""
        away = self.away.get(c)
        return away[1] if away is not None else [p.data for p in self.params[c]]

    def _target(self, c, v, saved):
        """Lazy: what an action of version v (its stash ``saved``) needs in chunk c's parameters:
        False when what is there will do, else the arrays (None: the current weights)."""
        away = self.away.get(c)
        if v == self.current[c]:  # the current weights, or a stashed copy of them in place
            return False if away is None or (saved is not None and away[0] is saved) else None
        return False if away is not None and away[0] is saved else saved

    def _bind(self, c, arrays) -> None:
        """Put ``arrays`` (None: the current weights) in chunk c's parameters."""
        away = self.away.pop(c, None)
        if arrays is None:
            arrays = away[1]
        else:
            self.away[c] = (arrays, away[1] if away is not None else
                            [p.data for p in self.params[c]])
        for p, w in zip(self.params[c], arrays):
            p.data = w
        self.binds += 1

    def home(self) -> None:
        """Lazy: the current weights back in every chunk's parameters (the drain: evaluation,
        checkpoints and the optimizer read them)."""
        for c in list(self.away):
            self._bind(c, None)

    def copies(self, mb, c) -> bool:
        """Whether ``keep(mb, c)`` copies a version or (lazy) swaps one in: the executor times
        that work as STASH, apart from the forward."""
        v = self.map[(mb, c)]
        if (mb, c) in self.live:
            return self.lazy and self._target(c, v, None) is not False
        if (c, v) not in self.kept:
            return True
        return self.lazy and self._target(c, v, self.kept[(c, v)]) is not False

    def keep(self, mb, c, chunk) -> None:
        """Before F(mb, c): stash its version's weights for its backward (copied when the rank
        holds no copy of that version yet and an UPDATE comes before the backward; None: the
        backward runs on the weights in place, ``live``)."""
        v = self.map[(mb, c)]
        live = (mb, c) in self.live
        saved = self.saved[(mb, c)] = None if live else self._weights(c, v, chunk)
        self.uses[(c, v)] -= 1
        if not self.uses[(c, v)]:
            self.kept.pop((c, v), None)  # the stash holds it until the backward
        if self.lazy:
            target = self._target(c, v, saved)
            if target is not False:
                self._bind(c, target)

    def forward(self, mb, c, chunk):
        """The context F(mb, c) runs in: the weights ``keep`` stashed for it swapped in, or
        nothing to do when they are the ones in place (most forwards: no generator made)."""
        saved = self.saved[(mb, c)]
        if self.lazy or saved is None or self.map[(mb, c)] == self.current[c]:
            return _IN_PLACE  # (lazy: ``keep`` put the version in)
        return _swapped(self.params[c], saved, zero=False)

    def swap_in(self, mb, c, chunk) -> list:
        """Before BW(mb, c): put in the weights F(mb, c) ran with (and zero the gradients when
        each micro-batch updates on its own). Returns the arrays ``restore`` puts back after
        the backward (lazy: None, the version stays). Kept apart from the backward so the
        executor times it on its own."""
        params = self.params[c]
        saved = self.saved.pop((mb, c))
        current = None
        if self.lazy:
            target = self._target(c, self.map[(mb, c)], saved)
            if target is not False:
                self._bind(c, target)
        elif saved is not None:  # None: the weights in place are the version (``live``)
            current = [p.data for p in params]
            for p, w in zip(params, saved):
                p.data = w
        if self.zero is not None and c not in self.clean:
            self.zero(c)
        self.clean.discard(c)
        return current

    def cleaned(self, c) -> None:
        """An UPDATE of chunk c left its gradients zero: its next backward starts from them."""
        self.clean.add(c)

    def _zero(self, c) -> None:
        for p in self.params[c]:
            p.zero_grad()

    def restore(self, chunk, current) -> None:
        """After BW: the current weights back in place (``swap_in``'s return)."""
        for p, w in zip(self.params[chunk.index], current or ()):
            p.data = w

    def updating(self, c, chunk):
        """Before an UPDATE of chunk c: keep a copy of the version it ends if a later forward
        needs it (2BW: the next step's forwards on the last stages; vertical sync). Lazy: the
        current weights go back in first (the optimizer updates them)."""
        if c in self.away:
            self._bind(c, None)
        v = self.current[c]
        if self.uses[(c, v)] > 0 and (c, v) not in self.kept:
            self.kept[(c, v)] = self._copy(c)
        self.current[c] = v + 1


def _live(schedule, chunks, versions) -> set:
    """{(mb, c)} of this rank's chunks whose forward runs on the current version and whose
    backward comes before the chunk's next UPDATE, in the rank's order of the lists."""
    live = set()
    for acts in schedule.ranks:
        done, open_ = {}, {}  # chunk -> UPDATEs so far; (mb, c) -> UPDATEs when F ran
        for a in acts:
            if a.chunk not in chunks:
                continue
            if a.op == "UPDATE":
                done[a.chunk] = done.get(a.chunk, 0) + 1
            elif a.op == "F":
                open_[(a.mb, a.chunk)] = done.get(a.chunk, 0)
            elif a.op == "BW" and (a.mb, a.chunk) in open_:  # (a split B/W: never live)
                at_f = open_.pop((a.mb, a.chunk))
                if at_f == done.get(a.chunk, 0) == versions.get((a.mb, a.chunk)):
                    live.add((a.mb, a.chunk))
    return live


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
