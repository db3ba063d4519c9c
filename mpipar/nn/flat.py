"""Flat parameter groups: the optimizer's view of many small tensors as a few long ones.

An element-wise update costs about a dozen array operations per tensor; a chunk of a small model
holds dozens of tensors, so its update is hundreds of calls of a few microseconds each (PipeDream
pays it once per micro-batch). When the gradients already lie packed in one flat buffer (the
trainer's gradient buckets, ``parallel.data.Bucket``: each ``param.grad`` a view into it), the
parameters' data can be packed in the same order, and the whole update becomes a handful of
operations over two long arrays. The elements and the operations on each of them are the same,
so the result is the same, bit for bit.

``flat_groups`` finds the packed runs of gradients; ``FlatGroup`` packs the data (and the
optimizer state) of one run to match, rebinding each ``param.data`` and state entry to a view
of the flat array, and remembers those views: ``valid`` says whether they are still the ones the
parameters hold (a weight swap puts the same views back; anything that rebinds a parameter's
data makes the optimizer lay out again). A tensor whose gradient is alone is a group of one, with
its own arrays (no copy).
"""

from __future__ import annotations

from operator import attrgetter, is_
from sys import getrefcount

import numpy as np

from ..backend import array_module

_DATA, _GRAD = attrgetter("data"), attrgetter("grad")


def _address(a) -> int:
    """The address of ``a``'s first element (NumPy or CuPy)."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return a.data.ptr


def _root(a):
    """The array that owns ``a``'s memory (its last array base), or ``a``."""
    kind = type(a)
    while isinstance(a.base, kind):
        a = a.base
    return a


def _contiguous(a) -> bool:
    return bool(a.flags.c_contiguous)


def _packed_runs(params) -> list[list]:
    """The parameters in runs whose gradients lie back to back (in address order) in one owning
    array; every other parameter a run of one. Runs never mix array modules or dtypes."""
    by_root = {}
    for p in params:
        g = p.grad
        ok = _contiguous(g) and _contiguous(p.data) and g.dtype == p.data.dtype
        key = (id(_root(g)), type(g), g.dtype.str) if ok else ("alone", id(p))
        by_root.setdefault(key, []).append(p)
    runs = []
    for group in by_root.values():
        group.sort(key=lambda p: _address(p.grad))
        run = [group[0]]
        for p in group[1:]:
            prev = run[-1].grad
            if _address(p.grad) == _address(prev) + prev.nbytes:
                run.append(p)
            else:
                runs.append(run)
                run = [p]
        runs.append(run)
    return runs


def _flat_view(views, total: int):
    """One 1-D array over ``total`` elements starting at ``views[0]``'s first element, taken
    from the owning array (``views`` lie back to back in it)."""
    first = views[0]
    root = _root(first)
    if len(views) == 1 and root is first:
        return first.reshape(-1)
    start = _address(first) - _address(root)
    raw = root.reshape(-1).view(np.uint8)  # a byte view: the owner may be typed otherwise
    return raw[start:start + total * first.itemsize].view(first.dtype)


class FlatGroup:
    """Parameters whose gradients lie back to back in one buffer; their data (and the state
    buffers ``buffers`` of ``state``) packed the same way (module doc)."""

    def __init__(self, params, state: dict, buffers):
        self.params = params
        n = sum(p.size for p in params)
        self.grad = _flat_view([p.grad for p in params], n)
        self.data = self._pack([p.data for p in params], n, "data")
        self.state = {b: self._pack([state[p.name][b] for p in params], n, None, state, b)
                      for b in buffers}
        self._datas, self._grads = [p.data for p in params], [p.grad for p in params]
        # decaying elements as (start, stop) runs of the flat arrays, adjacent ones merged
        self.decay_runs = []
        off = 0
        for p in params:
            if p.decay:
                if self.decay_runs and self.decay_runs[-1][1] == off:
                    self.decay_runs[-1] = (self.decay_runs[-1][0], off + p.size)
                else:
                    self.decay_runs.append((off, off + p.size))
            off += p.size
        self.size = n
        self.all_decay = self.decay_runs == [(0, n)]

    def _pack(self, arrays, n, attr, state=None, buffer=None):
        """One flat array holding ``arrays`` in order: the arrays' own memory when one of
        them, else a new array they are copied into; each parameter's data (``attr``) or
        state entry then a view of it."""
        if len(arrays) == 1:
            return arrays[0].reshape(-1)
        xp = array_module(arrays[0])
        flat = xp.empty(n, dtype=arrays[0].dtype)
        off = 0
        for p, a in zip(self.params, arrays):
            view = flat[off:off + a.size].reshape(a.shape)
            view[...] = a
            if attr is not None:
                setattr(p, attr, view)
            else:
                state[p.name][buffer] = view
            off += a.size
        return flat

    def valid(self) -> bool:
        """Whether every parameter still holds the views this group was laid out with (asked
        before every update: PipeDream's are per micro-batch, so the check runs in C, with no
        Python frame per parameter)."""
        return (all(map(is_, map(_DATA, self.params), self._datas))
                and all(map(is_, map(_GRAD, self.params), self._grads)))

    def runs_in(self, lo: int, hi: int) -> list:
        """The decaying elements within [lo, hi), as slices relative to ``lo``."""
        return [slice(max(a, lo) - lo, min(b, hi) - lo) for a, b in self.decay_runs
                if a < hi and b > lo]


def flat_groups(params, state: dict, buffers, fused: bool = True) -> list[FlatGroup]:
    """``params`` as ``FlatGroup``s: packed runs of gradients (``fused``), or one per
    parameter (the per-tensor update, for comparison)."""
    runs = _packed_runs(params) if fused else [[p] for p in params]
    return [FlatGroup(run, state, buffers) for run in runs]


class PackedCopier:
    """Copies of a list of arrays (one chunk's weights, for a stashed version) made with one
    copy per run of them lying back to back in memory (``FlatGroup`` packs them so) instead of
    one per array; each copy a view of the run's copy, in the arrays' shapes. The plan is made
    once and kept while the arrays are the same objects.

    A copy's memory is kept for the next copy once nothing holds any of its arrays any more
    (the stash dropped the version, no parameter or older buffer points at it): PipeDream's
    first stage copies a version per micro-batch, into the same few buffers and views instead
    of a fresh array (new pages to fault in, new views) each time. Whether anything holds a
    copy is its arrays' and buffers' reference counts: exact in CPython, and a copy still
    referenced anywhere (a layer's saved context, a checkpoint being written) is simply not
    reused. NumPy only (a CuPy view holds its memory, not its base array)."""

    POOL = 4  # copies kept for reuse (PipeDream at pp = 2 cycles through two)

    def __init__(self):
        self._key = None  # the arrays the plan was made for
        self._plan = None  # [(flat view of a run, [(index, first, end, shape)])]
        self._pool = []  # [(each run's copy buffer, the copy's arrays)] made by earlier copies

    def _make(self, arrays):
        order = sorted(range(len(arrays)), key=lambda i: _address(arrays[i]))
        runs, cur = [], [order[0]]
        for i in order[1:]:
            prev, a = arrays[cur[-1]], arrays[i]
            if (type(a) is type(prev) and a.dtype == prev.dtype and _contiguous(a)
                    and _contiguous(prev) and _root(a) is _root(prev)
                    and _address(a) == _address(prev) + prev.nbytes):
                cur.append(i)
            else:
                runs.append(cur)
                cur = [i]
        runs.append(cur)
        plan = []
        for run in runs:
            views = [arrays[i] for i in run]
            n = sum(v.size for v in views)
            flat = _flat_view(views, n) if _contiguous(views[0]) else None
            offs, off = [], 0
            for i in run:  # (index, first, end, shape): a copy makes each view with no sums
                offs.append((i, off, off + arrays[i].size, arrays[i].shape))
                off += arrays[i].size
            plan.append((flat, offs))
        return plan

    def copy(self, arrays) -> list:
        if self._key is None or len(self._key) != len(arrays) or \
                not all(map(is_, arrays, self._key)):
            self._key, self._plan = list(arrays), self._make(arrays)
            self._pool = []  # other arrays: other shapes
        entry = self._free()
        if entry is not None:  # the same plan: each run's buffer takes the run again
            bufs, views = entry
            for (flat, offs), buf in zip(self._plan, bufs):
                buf[...] = arrays[offs[0][0]] if flat is None else flat
            return list(views)  # a list of its own: the pool's holds no extra reference
        out, bufs = [None] * len(arrays), []
        for flat, offs in self._plan:
            if flat is None:  # not contiguous: a copy of its own
                (i, _, _, _), = offs
                buf = arrays[i].copy()
                out[i] = buf.view()  # (the buffer and the array handed out: two objects)
            else:
                buf = flat.copy()
                for i, lo, hi, shape in offs:
                    out[i] = buf[lo:hi].reshape(shape)
            bufs.append(buf)
        if len(self._pool) < self.POOL and all(type(b) is np.ndarray for b in bufs):
            self._pool.append((bufs, out))
            return list(out)
        return out

    def _free(self):
        """A copy of the pool none of whose memory is referenced outside it, or None: neither
        its arrays (a parameter, a stash's list) nor its buffers (any view derived from its
        arrays, ``w.T`` say, refers to the buffer that owns the memory)."""
        for bufs, arrays in self._pool:
            # a free array's references: the pool's list, ``a`` and getrefcount's argument
            if not all(getrefcount(a) <= _FREE_REFS for a in arrays):
                continue
            # a free buffer's: the pool's list, getrefcount's argument and one per array of
            # the copy made from it (each array's base)
            if all(getrefcount(bufs[k]) <= 2 + len(self._plan[k][1])
                   for k in range(len(bufs))):
                return bufs, arrays
        return None


_FREE_REFS = 3
