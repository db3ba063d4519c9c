"""Registered buffers: arrays that live in a shared window, reduced in place with no copy in.

``Comm.registered_zeros(sizes, dtype)`` (collective) allocates one MPI-3 shared window whose
segment on every rank holds the arrays at the same byte offsets, each page-aligned (like
Megatron's contiguous gradient buffer with NCCL user-buffer registration). The data-parallel
gradient buckets live there (``parallel/data.py``), so every rank can read and write every
other rank's bucket as plain NumPy memory, and a shared-memory collective (``shm.py``) on a
registered array skips its copies (p ranks, rank r, block r of p near-equal blocks):

- all-reduce: barrier (the header agreement: every rank's bucket is final); rank r reduces
  block r of every rank's bucket in rank order ((x0 + x1) + x2 ...) into rank 0's block r and
  copies it into block r of every other rank's bucket; barrier (every block written). Per rank
  it reads about n and writes n bytes, where the copying algorithms move 4-5 n. One rank
  computes each element, so the result is bitwise equal everywhere (and to the copying shm
  path's, which reduces in the same order).
- reduce-scatter: barrier; rank r reduces block r of every rank's input into its ``out``;
  barrier.

The closing barrier is what keeps a rank from writing its bucket again (the next step's
``zero_grad`` and backward) while a peer still reads it: a collective touches the others'
buckets only between its two barriers. (The copying shm path instead relies on the next
collective's first barrier: its window is written only inside a collective; a registered bucket
is written outside any.)

Every rank must pass the same registered array (the same window, byte offset, size and dtype);
the header agreement compares them with the call, so a rank passing a plain array, another
window or another offset raises the same error on every rank, as any disagreement there does.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from mpipar.mpi.algorithms import bounds
from mpipar.mpi.staging import load_mpi

PAGE = 4096
SHM_DIR = "/dev/shm"  # MPICH's and Open MPI's shared windows live in files here
# the reduction of a block goes in pieces of this many bytes, so the copies out to the other
# ranks' buckets read the result from the cache it was just written to
PIECE = 512 << 10


def offsets(sizes, dtype) -> list[int]:
    """Each array's byte offset in a segment: one after the other, each page-aligned."""
    out, off = [], 0
    for n in sizes:
        out.append(off)
        off += -(-int(n) * np.dtype(dtype).itemsize // PAGE) * PAGE
    return out


def segment_bytes(sizes, dtype) -> int:
    """One rank's segment of a window holding arrays of ``sizes`` elements."""
    n = int(sizes[-1]) * np.dtype(dtype).itemsize if len(sizes) else 0
    end = offsets(sizes, dtype)[-1] + -(-n // PAGE) * PAGE if len(sizes) else 0
    return max(end, PAGE)


def room_for(nbytes, path=SHM_DIR) -> bool:
    """Whether the node's shared-memory file system (where MPI places shared windows) has
    ``nbytes`` free; True where it cannot be told (then MPI decides)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize >= nbytes


class Registered:
    """One shared window of registered arrays: the same layout in every rank's segment."""

    def __init__(self, comm, sizes, dtype, number):
        MPI = load_mpi()
        dtype = np.dtype(dtype)
        self.number = number  # this window's place among the communicator's (in the header)
        self.offsets = offsets(sizes, dtype)
        self.nbytes = segment_bytes(sizes, dtype)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's NUMA node
        try:
            self.win = MPI.Win.Allocate_shared(self.nbytes, 1, info, comm)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # as shm.Window: the barriers order the accesses
        self.mem = [self.win.Shared_query(q)[0] for q in range(comm.Get_size())]
        self.seg = [np.frombuffer(m, np.uint8) for m in self.mem]
        me = self.seg[comm.Get_rank()]
        me[:] = 0  # MPI does not promise zeros; also places the pages (first touch) here
        self.lo = me.ctypes.data
        self.hi = self.lo + self.nbytes
        # each array a view of its own slice of the segment's buffer, so its ``base`` counts
        # its own bytes (training.memory counts a view's base), not the whole window
        rank = comm.Get_rank()
        self.arrays = [np.frombuffer(self.mem[rank][o:o + int(n) * dtype.itemsize], dtype)
                       for o, n in zip(self.offsets, sizes, strict=True)]
        # the arrays' identities: a view of one (a slice, a reshape) has it as its ``base``, so
        # ``locate`` rejects any other array with two set lookups, where reading an address
        # (``ctypes.data``, ~1 us) on every collective of the communicator cost more than a
        # small all-reduce itself
        self.roots = frozenset(id(a) for a in self.arrays)
        self._seen = {}  # id(array) -> (weak reference, offset): a bucket is reduced every step

    def locate(self, x):
        """The byte offset of contiguous host array ``x`` in this rank's segment, or None."""
        roots = self.roots
        if type(x) is not np.ndarray or (id(x) not in roots and id(x.base) not in roots):
            return None
        seen = self._seen.get(id(x))
        if seen is not None and seen[0]() is x:  # the same object (not a reused id)
            return seen[1]
        if not x.flags.c_contiguous:
            return None
        addr = x.ctypes.data
        if not (self.lo <= addr and addr + x.nbytes <= self.hi):
            return None
        if len(self._seen) > 4096:
            self._seen.clear()
        self._seen[id(x)] = (weakref.ref(x), addr - self.lo)
        return addr - self.lo

    def views(self, off, dtype, n):
        """Every rank's n elements of ``dtype`` at byte offset ``off``."""
        return [s[off:off + n * dtype.itemsize].view(dtype) for s in self.seg]

    def free(self) -> None:
        self.seg = self.mem = self.arrays = []  # no view of ours may outlive the memory
        self.roots, self._seen = frozenset(), {}
        self.win.Unlock_all()
        self.win.Free()


def allreduce(shm, reg, off, flat, op, what, across=None):
    """Steps of an in-place all-reduce of ``flat``, registered at byte ``off`` of ``reg``;
    ``across``: as ``Shm.allreduce``'s (its dests: block r of every rank's buffer)."""
    p, r, dt = shm.size, shm.rank, flat.dtype
    ufunc = np.maximum if op == "max" else np.add
    yield from _agree(shm, reg, what, "allreduce", op, dt, flat.nbytes, off)
    b = bounds(flat.size, p)
    blocks = [v[b[r]:b[r + 1]] for v in reg.views(off, dt, flat.size)]
    if across is not None:
        yield from across(blocks, blocks, ufunc)  # the node's sum into rank 0's block first
    else:
        reduce_to_all(ufunc, blocks, max(1, PIECE // dt.itemsize))
    yield from _sync(shm, reg)  # every block of every bucket written; none read after this


def reduce_to_all(ufunc, blocks, step) -> None:
    """Every rank's block r: their reduction, in ``step``-element pieces (cache-sized)."""
    for lo in range(0, blocks[0].size, step):
        parts = [blk[lo:lo + step] for blk in blocks]
        # into rank 0's block: it is read first, and only here (other ranks own other blocks)
        reduce_in_order(ufunc, parts, parts[0])
        for part in parts[1:]:
            part[...] = parts[0]


def reduce_scatter(shm, reg, off, x, out, op, what):
    """Steps of a reduce-scatter of ``x`` (p equal blocks), registered at byte ``off`` of
    ``reg``, into this rank's ``out``."""
    p, r, dt = shm.size, shm.rank, x.dtype
    ufunc = np.maximum if op == "max" else np.add
    k = out.size
    yield from _agree(shm, reg, what, "reduce_scatter", op, dt, x.nbytes, off)
    parts = [v[r * k:(r + 1) * k] for v in reg.views(off, dt, p * k)]
    # out overlapping x (anyone's block of it): the result waits until nobody reads x
    alias = np.may_share_memory(out, x)
    acc = np.empty(k, dt) if alias else out
    if k:
        reduce_in_order(ufunc, parts, acc)
    yield from _sync(shm, reg)  # nobody reads anyone's x after this: each may write its own
    if alias:
        out[...] = acc


def _agree(shm, reg, what, kind, op, dtype, nbytes, off):
    """shm's header agreement, its barrier also ordering the registered window's accesses."""
    reg.win.Sync()
    yield from shm._agree(what, kind, op, dtype, nbytes, (reg.number, off))
    reg.win.Sync()


def _sync(shm, reg):
    reg.win.Sync()
    yield from shm._sync()
    reg.win.Sync()


def reduce_in_order(ufunc, parts, acc) -> None:
    """acc = ((parts[0] op parts[1]) op parts[2]) ...: the same order on every rank. ``acc`` may
    be parts[0] itself (no other rank reads it meanwhile)."""
    ufunc(parts[0], parts[1], out=acc)
    for part in parts[2:]:
        ufunc(acc, part, out=acc)
