"""The weight stash walked through a rank's lists without a model (no MPI): every forward and
backward sees its version's weights, lazily swapped (a continuous run) as eagerly, with fewer
swaps; an UPDATE that zeroed the gradients spares the next backward its own zeroing."""

import numpy as np
import pytest

from mpipar.parallel.pipeline.generators import build_schedule, weight_versions
from mpipar.parallel.pipeline.stash import _IN_PLACE, VersionStash


class _Param:
    def __init__(self, n):
        self.data, self.grad = np.zeros(n), np.zeros(n)

    def zero_grad(self):
        self.grad[...] = 0


class _Chunk:
    """Two parameters whose every element holds the chunk's version number (an UPDATE adds 1
    in place, as the optimizer writes the current weights)."""

    def __init__(self, index, older=False):
        self.index = index
        self._params = [_Param(3), _Param(5)]
        if older:  # 2BW's older buffer carried in: version -1
            self.older = [np.full(3, -1.0), np.full(5, -1.0)]

    def params(self):
        return self._params


def _walk(s, r, lazy, zeroing=False):
    """Runs rank r's lists through a stash as the executor does; returns (versions seen by
    each F and BW, swaps (lazy: ``binds``; eager: two per swapped action), zeroings before a
    backward)."""
    mine = sorted({a.chunk for a in s.ranks[r]})
    chunks = {c: _Chunk(c, older=s.kind == "pipedream-2bw") for c in mine}
    older = {c: ch.older for c, ch in chunks.items()} if s.kind == "pipedream-2bw" else None
    zeros = []
    stash = VersionStash(s, chunks, older, lazy=lazy,
                         zero_each=(lambda c: zeros.append(c)) if zeroing else False)
    seen, eager = [], 0

    def version(c):
        ws = [p.data for p in chunks[c].params()]
        assert all(np.all(w == ws[0][0]) for w in ws), ws  # one version in all parameters
        return int(ws[0][0])

    for a in s.ranks[r]:
        c, chunk = a.chunk, chunks[a.chunk]
        if a.op == "F":
            stash.keep(a.mb, c, chunk)
            ctx = stash.forward(a.mb, c, chunk)
            eager += 2 * (ctx is not _IN_PLACE)
            with ctx:
                seen.append(("F", a.mb, c, version(c)))
        elif a.op == "BW":
            current = stash.swap_in(a.mb, c, chunk)
            eager += 2 * (current is not None)
            seen.append(("BW", a.mb, c, version(c)))
            stash.restore(chunk, current)
        elif a.op == "UPDATE":
            stash.updating(c, chunk)
            for p in chunk.params():
                p.data += 1
            if zeroing:
                stash.cleaned(c)
    stash.home()
    for c in chunks:  # the current weights back in place at the end
        assert version(c) == stash.current[c]
    return seen, stash.binds if lazy else eager, zeros


CASES = [("pipedream", 2, 4, False), ("pipedream", 4, 3, False), ("pipedream", 4, 4, True),
         ("pipedream-2bw", 2, 4, False), ("pipedream-2bw", 4, 3, False),
         ("pipedream-2bw", 2, 1, False)]


@pytest.mark.parametrize("kind,pp,m,vsync", CASES)
def test_lazy_stash_gives_every_action_its_version_with_fewer_swaps(kind, pp, m, vsync):
    steps = 4
    s = build_schedule(kind, pp, m, steps=steps, vertical_sync=vsync)
    want = weight_versions(s)
    for r in range(pp):
        eager, swaps, _ = _walk(s, r, lazy=False)
        lazy, binds, _ = _walk(s, r, lazy=True)
        assert lazy == eager  # the same versions, action by action
        assert all(v == want[(mb, c)] for _, mb, c, v in lazy)
        assert binds <= swaps, (r, binds, swaps)
        if kind == "pipedream-2bw" and pp == 2 and m > 1:  # a few per step, not per action
            assert binds <= 4 * steps < swaps / 3, (r, binds, swaps)


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
def test_a_cleaned_chunk_skips_its_next_zeroing_only(kind):
    """After an UPDATE that zeroed (``cleaned``) the chunk's next backward zeroes nothing; any
    backward after another backward zeroes as before (PipeDream: only the first of the run;
    2BW's backwards accumulate, so all but the first of each step would, with zero_each)."""
    s = build_schedule(kind, 2, 3, steps=3)
    for r in range(2):
        want, after_update = [], False
        for a in s.ranks[r]:
            if a.op == "BW":
                if not after_update:
                    want.append(a.chunk)
                after_update = False
            elif a.op == "UPDATE":
                after_update = True
        _, _, zeros = _walk(s, r, lazy=True, zeroing=True)
        assert zeros == want
        assert (len(want) == 1) == (kind == "pipedream")
