"""Collective algorithms built from point-to-point messages: ring and Rabenseifner.

Each algorithm is a generator over a flat, contiguous buffer: it posts one step's ``Isend`` /
``Irecv`` pair, yields the requests, and does that step's local reduction when resumed. The
blocking collective drives it with ``Waitall``; the non-blocking one (``Stepper``) advances it
from ``Test`` calls, so a data-parallel bucket progresses whenever the executor tests anything
(``progress()``) and finishes at ``wait``.

- ring (Patarasuk & Yuan 2009): reduce-scatter then all-gather around the ring, p - 1 steps each;
  bandwidth-optimal for any p.
- rabenseifner (Thakur, Rabenseifner & Gropp 2005): recursive halving reduce-scatter, recursive
  doubling all-gather, log2 p steps each; a non-power-of-two p first folds ranks 2i into 2i + 1.

Every element of the result is reduced by exactly one rank, in one fixed order, and then copied to
the others, so the result is bitwise equal on every rank (an all-reduce where each rank sums for
itself may round differently per rank). Messages travel on a duplicate of the communicator with a
per-collective tag, so they never match the pipeline's point-to-point messages or another
collective still in flight.
"""

from __future__ import annotations

import numpy as np

from mpipar.mpi.staging import load_mpi, sync_device

# shm: shm.py, ranks of one node; hier: hierarchical.py, ranks on several nodes
ALGORITHMS = ("library", "ring", "rabenseifner", "shm", "hier")
KINDS = ("allreduce", "reduce_scatter", "allgather")


def bounds(n, p):
    """Element offsets of p near-equal blocks of n elements (the first n % p one longer)."""
    q, r = divmod(n, p)
    return [i * q + min(i, r) for i in range(p + 1)]


def reducer(op, device):
    """reduce(dst, src): dst op= src, finished on return (MPI reads dst next)."""
    ufunc = np.maximum if op == "max" else np.add

    def reduce(dst, src):
        if dst.size:
            ufunc(dst, src, out=dst)
            if device:
                sync_device()

    return reduce


class Ctx:
    """What one run of an algorithm needs: the communicator, rank, size, tag and reducer."""

    __slots__ = ("mpi", "rank", "size", "tag", "reduce", "BYTE")

    def __init__(self, mpi, tag, reduce):
        self.mpi, self.tag, self.reduce = mpi, tag, reduce
        self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
        self.BYTE = load_mpi().BYTE

    def xchg(self, send, dest, recv, source):
        """Post one step: receive into ``recv`` from source, send ``send`` to dest."""
        reqs = []
        if recv is not None:
            reqs.append(self.mpi.Irecv([recv, self.BYTE], source, self.tag))
        if send is not None:
            reqs.append(self.mpi.Isend([send, self.BYTE], dest, self.tag))
        return reqs


# --- ring ----------------------------------------------------------------------------------


def ring_reduce_scatter(c, buf, tmp, b):
    """In place: afterwards block r of buf (elements b[r]:b[r+1]) is the reduction on rank r."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        si, ri = (r - s - 1) % p, (r - s - 2) % p
        dst = buf[b[ri]:b[ri + 1]]
        t = tmp[:dst.size]
        yield c.xchg(buf[b[si]:b[si + 1]], right, t, left)
        c.reduce(dst, t)


def ring_allgather(c, buf, b):
    """In place: block r of buf is rank r's; afterwards every block is everywhere."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        si, ri = (r - s) % p, (r - s - 1) % p
        yield c.xchg(buf[b[si]:b[si + 1]], right, buf[b[ri]:b[ri + 1]], left)


def ring_allreduce(c, buf, tmp):
    b = bounds(buf.size, c.size)
    yield from ring_reduce_scatter(c, buf, tmp, b)
    yield from ring_allgather(c, buf, b)


# --- Rabenseifner: recursive halving / doubling --------------------------------------------


class Fold:
    """A non-power-of-two group folded onto p2 = 2^k participants.

    Ranks 2i and 2i + 1 (i < rem = p - p2) become participant i (played by 2i + 1); rank r >= 2 rem
    becomes participant r - rem. Participant j's segment is the blocks of the ranks it stands for,
    so segments are contiguous and in rank order.
    """

    def __init__(self, p, r):
        self.p2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.p2
        self.idle = r < 2 * self.rem and r % 2 == 0  # folded into r + 1
        self.new = (r // 2 if r < 2 * self.rem else r - self.rem)

    def orig(self, j):
        return 2 * j + 1 if j < self.rem else j + self.rem

    def first(self, j):
        """The lowest original rank participant j stands for."""
        return 2 * j if j < self.rem else j + self.rem


def halving(c, f, buf, tmp, seg):
    """Recursive halving among participants; afterwards segment f.new is reduced here."""
    lo, hi, d = 0, f.p2, f.p2 // 2
    while d >= 1:
        mid = (lo + hi) // 2
        upper = bool(f.new & d)
        keep = (mid, hi) if upper else (lo, mid)
        give = (lo, mid) if upper else (mid, hi)
        dst = buf[seg[keep[0]]:seg[keep[1]]]
        t = tmp[:dst.size]
        peer = f.orig(f.new ^ d)
        yield c.xchg(buf[seg[give[0]]:seg[give[1]]], peer, t, peer)
        c.reduce(dst, t)
        lo, hi = keep
        d //= 2


def doubling(c, f, buf, seg):
    """Recursive doubling among participants: from segment f.new here to all of them."""
    lo, hi, d = f.new, f.new + 1, 1
    while d < f.p2:
        peer_lo = lo - d if f.new & d else hi
        peer = f.orig(f.new ^ d)
        yield c.xchg(buf[seg[lo]:seg[hi]], peer, buf[seg[peer_lo]:seg[peer_lo + d]], peer)
        lo, hi = min(lo, peer_lo), max(hi, peer_lo + d)
        d *= 2


def _segments(f, b):
    return [b[f.first(j)] for j in range(f.p2)] + [b[-1]]


def rabenseifner_allreduce(c, buf, tmp):
    f = Fold(c.size, c.rank)
    r = c.rank
    if f.idle:
        yield c.xchg(buf, r + 1, None, None)
        yield c.xchg(None, None, buf, r + 1)
        return
    if r < 2 * f.rem:
        t = tmp[:buf.size]
        yield c.xchg(None, None, t, r - 1)
        c.reduce(buf, t)
    seg = _segments(f, bounds(buf.size, c.size))
    yield from halving(c, f, buf, tmp, seg)
    yield from doubling(c, f, buf, seg)
    if r < 2 * f.rem:
        yield c.xchg(buf, r - 1, None, None)


def rabenseifner_reduce_scatter(c, buf, tmp, out):
    """buf: a scratch copy of the input (p equal blocks); out: this rank's block."""
    f = Fold(c.size, c.rank)
    r, b = c.rank, bounds(buf.size, c.size)
    if f.idle:
        yield c.xchg(buf, r + 1, None, None)
        yield c.xchg(None, None, out, r + 1)
        return
    if r < 2 * f.rem:
        t = tmp[:buf.size]
        yield c.xchg(None, None, t, r - 1)
        c.reduce(buf, t)
    yield from halving(c, f, buf, tmp, _segments(f, b))
    if r < 2 * f.rem:
        yield c.xchg(buf[b[r - 1]:b[r]], r - 1, None, None)
    out[...] = buf[b[r]:b[r + 1]]


def rabenseifner_allgather(c, buf):
    """buf: p equal blocks, block r already holds this rank's part."""
    f = Fold(c.size, c.rank)
    r, b = c.rank, bounds(buf.size, c.size)
    if f.idle:
        yield c.xchg(buf[b[r]:b[r + 1]], r + 1, None, None)
        yield c.xchg(None, None, buf, r + 1)
        return
    if r < 2 * f.rem:
        yield c.xchg(None, None, buf[b[r - 1]:b[r]], r - 1)
    yield from doubling(c, f, buf, _segments(f, b))
    if r < 2 * f.rem:
        yield c.xchg(buf, r - 1, None, None)


# --- driving a generator --------------------------------------------------------------------


def run(steps) -> None:
    """Run an algorithm to the end, blocking."""
    Waitall = load_mpi().Request.Waitall
    for reqs in steps:
        Waitall(reqs)


class Stepper:
    """An algorithm in flight, shaped like an mpi4py request (``Test`` / ``Wait``) so ``Request``
    can hold it. ``Test`` advances as many steps as have arrived, never blocking."""

    __slots__ = ("steps", "reqs")

    def __init__(self, steps):
        self.steps = steps
        self.reqs = next(steps, None)

    def Test(self, status=None) -> bool:  # noqa: N802 (mpi4py's name)
        Testall = load_mpi().Request.Testall
        while self.reqs is not None:
            if not Testall(self.reqs):
                return False
            self.reqs = next(self.steps, None)
        return True

    def advance(self) -> None:
        """One step, blocking: wait for the posted messages, then run the next step."""
        if self.reqs is not None:
            load_mpi().Request.Waitall(self.reqs)
            self.reqs = next(self.steps, None)

    def Wait(self, status=None) -> None:  # noqa: N802
        Waitall = load_mpi().Request.Waitall
        while self.reqs is not None:
            Waitall(self.reqs)
            self.reqs = next(self.steps, None)


# --- outstanding non-blocking collectives, progressed from cheap test points ----------------

PENDING: list = []  # Requests of non-blocking collectives not yet known to be done
# the same list, read-only for other layers: truthy while any is outstanding. A loop that checks
# between every two actions reads it rather than calling ``in_flight`` (BENCHMARKS.md, "Eighth
# cuts": a call per action costs more than its work). Only this module changes it, in place.
pending_collectives = PENDING


def in_flight() -> bool:
    """Whether any non-blocking collective is outstanding (``progress`` has work to do)."""
    return bool(PENDING)


def progress() -> None:
    """Advance every outstanding non-blocking collective as far as its messages allow.

    Cheap when nothing is pending; the pipeline executor calls it between actions.
    """
    if PENDING:
        PENDING[:] = [r for r in PENDING if not r.test()]
