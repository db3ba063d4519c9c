"""All-reduce, reduce-scatter and all-gather through memory shared by the ranks of one node.

An MPI-3 shared window (``Win.Allocate_shared``) gives every rank of the communicator a segment
the others can read and write as plain NumPy arrays. A collective then moves each byte through
memory a few times, with a few barriers, instead of through the library's messages (p ranks,
rank r, p blocks of the message):

- all-reduce: each rank copies its input's blocks but its own into its segment; barrier; rank r
  reduces block r of every rank's input (its own from its own memory), in rank order
  ((x0 + x1) + x2 ...), into block r of its segment; barrier; every rank copies every segment's
  own block out. Each element is reduced by one rank in one fixed order, so the result is
  bitwise equal on every rank (and to the reduce-scatter's blocks).
- reduce-scatter: the same copy in; barrier; rank r reduces block r straight into its output.
- all-gather: each rank copies its block in; barrier; every rank copies every segment out.

Before any data, each rank writes what it was called with (call number, kind, op, bytes, dtype)
into its segment's header and all compare after the first barrier: a disagreement raises the
same error on every rank (nobody waits in a barrier the others never reach), and an agreed size
larger than the window grows it, on every rank at once (a collective ``Allocate_shared``). The
window is one per communicator, sized to a power of two (``MIN_BYTES`` up to ``MAX_BYTES`` per
rank); a larger message goes through it in chunks. The next collective's first barrier is what
keeps a rank from overwriting its segment while another still reads it.

A collective is a generator of steps (``algorithms.Stepper`` shape), each step ending in an
``Ibarrier``: the blocking collective waits on each, a non-blocking one advances at every
``progress()`` / ``test()`` whose barrier has completed. One collective runs at a time per
communicator (their barriers match in the order posted): starting a copying one first finishes
the one before (shared memory is filled by this rank's own copies, so two in flight would only
hold twice the memory); a registered buffer's is queued (``Queued``) and starts when the ones
before it end, so that posting a gradient bucket during the backward never waits there.
Growing the window is a blocking collective, so it happens only at a post or in a blocking
call (the same point on every rank), never inside a ``test()``: queued collectives never grow
it.

An array that is a registered buffer (``Comm.registered_zeros``, ``shm_registered.py``: it
lives in a shared window already, at the same offset on every rank) skips the copies: all-reduce
and reduce-scatter read the other ranks' buffers where they are (two barriers, no window
growth); the header then also carries the buffer's window and offset, compared like the rest.

Only offered where every rank of the communicator shares one node (``Split_type(SHARED)``);
elsewhere ``tuning.choose`` falls back on the other algorithms.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from mpipar.mpi.algorithms import Stepper, bounds
from mpipar.mpi.algorithms import run as run_steps
from mpipar.mpi.shm_registered import allreduce as registered_allreduce
from mpipar.mpi.shm_registered import reduce_in_order
from mpipar.mpi.shm_registered import reduce_scatter as registered_reduce_scatter
from mpipar.mpi.staging import from_host, is_device, load_mpi, to_host

HEADER = 4096  # bytes before each rank's data: the call's description; keeps data page-aligned
MIN_BYTES = 1 << 20  # the smallest window, per rank
MAX_BYTES = 64 << 20  # the largest, per rank; a longer message goes through in chunks
_KINDS = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3}
_OPS = {"sum": 1, "mean": 2, "max": 3}
# call number, kind, op, bytes, dtype number, item size, and for a registered buffer
# (shm_registered.py) its window's number and byte offset (-1, -1 for any other array)
_FIELDS = 8
_DTYPE_NAMES = {np.dtype(c).num: np.dtype(c).name for c in np.typecodes["All"]}


def on_one_node(comm) -> bool:
    """Whether every rank of ``comm`` shares this node's memory (collective)."""
    node = comm.Split_type(load_mpi().COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def size_class(nbytes) -> int:
    """The window for a message of ``nbytes`` per rank: a power of two in MIN..MAX_BYTES."""
    return min(MAX_BYTES, max(MIN_BYTES, 1 << (max(1, int(nbytes)) - 1).bit_length()))


class Window:
    """One shared window: per rank ``HEADER`` bytes, then ``capacity`` bytes of data."""

    def __init__(self, comm, capacity):
        MPI = load_mpi()
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's NUMA node
        try:
            self.win = MPI.Win.Allocate_shared(HEADER + capacity, 1, info, comm)
        finally:
            info.Free()
        # a passive-target epoch for the window's lifetime: Win.Sync needs one, and the
        # barriers order the accesses (MPI's unified memory model for shared windows)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.capacity = capacity
        self.seg = [np.frombuffer(self.win.Shared_query(q)[0], np.uint8)
                    for q in range(comm.Get_size())]
        self.hdr = [s[:HEADER].view(np.int64) for s in self.seg]

    def data(self, q, dtype, n) -> np.ndarray:
        """The first n elements of rank q's data as ``dtype``."""
        return self.seg[q][HEADER:HEADER + n * dtype.itemsize].view(dtype)

    def free(self) -> None:
        self.seg = self.hdr = []  # no view may outlive the memory
        self.win.Unlock_all()
        self.win.Free()


class Shm:
    """The shared-memory collectives of one communicator whose ranks share a node."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.window = Window(comm, MIN_BYTES)
        self.calls = 0  # shared-memory collectives started here: the same count on every rank
        self.busy = None  # the Stepper of the collective in flight
        self.owner = None  # the Queued whose Stepper ``busy`` is (None: a copying collective's)
        self.queue = deque()  # registered collectives posted behind ``busy``, in call order
        self.regs = []  # shm_registered.Registered windows (Comm.registered_zeros), in order

    @classmethod
    def create(cls, comm):
        """A Shm for ``comm``, or None where its ranks span nodes or the library has no shared
        windows (collective)."""
        try:
            return cls(comm) if on_one_node(comm) else None
        except (NotImplementedError, load_mpi().Exception):
            return None  # an MPI before 3.0, or windows refused: the same on every rank

    def free(self) -> None:
        self.finish_busy()
        self.window.free()
        for reg in self.regs:
            reg.free()
        self.regs.clear()

    def locate(self, x):
        """(registered window, byte offset) of host array ``x`` when it lies, contiguous, in one
        of this communicator's registered windows; else None."""
        for reg in self.regs:
            off = reg.locate(x)
            if off is not None:
                return reg, off
        return None

    # --- driving -------------------------------------------------------------------------

    def finish_busy(self) -> None:
        """Finish the collective in flight and every one queued behind it (blocking)."""
        while self.busy is not None or self.queue:
            if self.busy is None:
                self._start_next()
            self.busy.Wait()
            self._retire()

    def run(self, steps) -> None:
        """Run a collective's steps to the end (blocking)."""
        self.finish_busy()
        run_steps(steps)

    def start(self, steps, need, queued=False):
        """A collective's steps posted (the non-blocking path): a Stepper, or with ``queued``
        (a registered buffer's: it never grows the window) a ``Queued`` that starts when the
        ones before it are done, advanced by its own and their ``Test``. A copying collective
        first finishes everything in flight. ``need``: the data bytes per rank; where they
        outgrow the window, the call agreement and the growth run here, blocking, the same call
        on every rank, instead of inside a later ``test()``."""
        if queued:
            q = Queued(self, steps)
            self.queue.append(q)
            self.pump(q, block=False)  # starts at once when nothing is in flight
            return q
        self.finish_busy()
        stepper = Stepper(steps)  # header written, first barrier posted
        if self.window.capacity < min(need, MAX_BYTES):
            stepper.advance()
        self.busy = stepper
        return stepper

    def pump(self, q, block) -> bool:
        """Advance the collectives in flight and queued up to ``q``: until it is done (block)
        or nothing more has arrived. Whether ``q`` is done. Each starts when the one before it
        has ended on this rank, so every rank posts their barriers in one order (call order)
        on one communicator: the reason for the queue (module docstring)."""
        while not q.done:
            if self.busy is None:
                self._start_next()
                continue
            if block:
                self.busy.Wait()
            elif not self.busy.Test():
                return False
            self._retire()
        return True

    def _start_next(self) -> None:
        self.owner = self.queue.popleft()
        self.busy = self.owner.stepper = Stepper(self.owner.steps)  # header, first barrier

    def _retire(self) -> None:
        if self.owner is not None:
            self.owner.done = True
        self.busy = self.owner = None

    def _sync(self):
        """A barrier step: writes before it are seen by every rank after it."""
        win = self.window.win
        win.Sync()
        yield [self.comm.Ibarrier()]
        win.Sync()

    def _agree(self, what, kind, op, dtype, nbytes, where=(-1, -1)):
        """Header, barrier, every rank's call compared; the window grown to fit ``nbytes``.
        ``where``: a registered buffer's (window number, byte offset), which every rank must
        pass alike (its data is not copied: the window need not grow)."""
        self.calls += 1
        mine = (self.calls, _KINDS[kind], _OPS[op], nbytes, dtype.num, dtype.itemsize) + where
        self.window.hdr[self.rank][:_FIELDS] = mine
        yield from self._sync()
        rows = np.array([h[:_FIELDS] for h in self.window.hdr])
        if (rows != rows[0]).any():
            # every rank read the same rows: none may start its next collective (and write
            # its header again) before the slowest has read them, or that one sees other rows
            self.comm.Barrier()
            raise ValueError(f"{what}: the ranks' calls disagree ({describe(rows)}); every "
                             f"rank must call the same collective with the same shape and dtype")
        if where[0] < 0 and self.window.capacity < min(nbytes, MAX_BYTES):
            self.window.free()
            self.window = Window(self.comm, size_class(nbytes))

    # --- the collectives (host arrays; a device array goes through a host copy) -----------

    def allreduce(self, flat, op, what, across=None):
        """In place over the 1-D array ``flat``; zero-copy where it is a registered buffer.
        ``across(parts, dests, ufunc)``: steps that reduce this rank's block (``parts``, one per
        rank) into ``dests`` with more than this node's ranks (``hierarchical.py``); None: the
        node's ranks only (``reduce_in_order``)."""
        loc = self.locate(flat) if self.regs else None
        if loc is not None:
            yield from registered_allreduce(self, *loc, flat, op, what, across)
        elif is_device(flat):
            host = host_copy(flat)
            yield from self._allreduce(host, op, what, across)
            from_host(host, flat)
        else:
            yield from self._allreduce(flat, op, what, across)

    def _allreduce(self, flat, op, what, across=None):
        p, r, dt = self.size, self.rank, flat.dtype
        ufunc = np.maximum if op == "max" else np.add
        yield from self._agree(what, "allreduce", op, dt, flat.nbytes)
        step = self.window.capacity // dt.itemsize
        for lo in range(0, flat.size, step):
            hi = min(flat.size, lo + step)
            if lo:
                yield from self._sync()  # every rank has copied the last chunk out
            f = flat[lo:hi]
            segs = [self.window.data(q, dt, hi - lo) for q in range(p)]
            b = bounds(hi - lo, p)
            mine, s = segs[r], slice(b[r], b[r + 1])
            mine[:b[r]] = f[:b[r]]  # the blocks the others reduce (block r stays here)
            mine[b[r + 1]:] = f[b[r + 1]:]
            yield from self._sync()
            parts = [seg[s] for seg in segs]
            parts[r] = f[s]
            if across is None:
                reduce_in_order(ufunc, parts, mine[s])  # the result's block r, for every rank
            else:
                yield from across(parts, [mine[s]], ufunc)
            yield from self._sync()
            for q in range(p):
                f[b[q]:b[q + 1]] = segs[q][b[q]:b[q + 1]]

    def reduce_scatter(self, x, out, op, what):
        """Block r of the reduction of every rank's 1-D x (p equal blocks) into 1-D ``out``
        (not overlapping x); x is not copied where it is a registered buffer."""
        loc = self.locate(x) if self.regs else None
        if loc is not None:
            yield from registered_reduce_scatter(self, *loc, x, out, op, what)
        elif is_device(x) or is_device(out):
            host = np.empty(out.shape, out.dtype)
            yield from self._reduce_scatter(host_copy(x) if is_device(x) else x, host, op, what)
            store(host, out)
        else:
            yield from self._reduce_scatter(x, out, op, what)

    def _reduce_scatter(self, x, out, op, what):
        p, r, dt = self.size, self.rank, x.dtype
        ufunc = np.maximum if op == "max" else np.add
        k = out.size
        yield from self._agree(what, "reduce_scatter", op, dt, x.nbytes)
        step = max(1, self.window.capacity // (dt.itemsize * p))  # of each block, per round
        for lo in range(0, k, step):
            hi = min(k, lo + step)
            m = hi - lo
            if lo:
                yield from self._sync()  # every rank has read its blocks of the last round
            segs = [self.window.data(q, dt, p * m) for q in range(p)]
            for q in range(p):
                if q != r:  # block r is reduced here, from x itself
                    segs[r][q * m:(q + 1) * m] = x[q * k + lo:q * k + hi]
            yield from self._sync()
            parts = [seg[r * m:(r + 1) * m] for seg in segs]
            parts[r] = x[r * k + lo:r * k + hi]
            reduce_in_order(ufunc, parts, out[lo:hi])

    def allgather(self, x, out, what):
        """Every rank's 1-D x, in rank order, into 1-D ``out``."""
        if is_device(x) or is_device(out):
            host = np.empty(out.shape, out.dtype)
            yield from self._allgather(host_copy(x) if is_device(x) else x, host, what)
            store(host, out)
        else:
            yield from self._allgather(x, out, what)

    def _allgather(self, x, out, what):
        p, r, dt = self.size, self.rank, x.dtype
        k = x.size
        in_place = k and x.ctypes.data == out[r * k:].ctypes.data  # x is out's block r
        yield from self._agree(what, "allgather", "sum", dt, x.nbytes)
        step = self.window.capacity // dt.itemsize
        for lo in range(0, k, step):
            hi = min(k, lo + step)
            if lo:
                yield from self._sync()  # every rank has copied the last chunk out
            segs = [self.window.data(q, dt, hi - lo) for q in range(p)]
            segs[r][:] = x[lo:hi]
            yield from self._sync()
            for q in range(p):
                if q != r:
                    out[q * k + lo:q * k + hi] = segs[q]
                elif not in_place:
                    out[q * k + lo:q * k + hi] = x[lo:hi]


class Queued:
    """A registered buffer's collective posted behind others (``Shm.start(queued=True)``),
    shaped like an mpi4py request (``Test`` / ``Wait``) so ``Request`` can hold it."""

    __slots__ = ("shm", "steps", "stepper", "done")

    def __init__(self, shm, steps):
        self.shm, self.steps, self.stepper, self.done = shm, steps, None, False

    def Test(self, status=None) -> bool:  # noqa: N802 (mpi4py's name)
        return self.shm.pump(self, block=False)

    def Wait(self, status=None) -> None:  # noqa: N802
        self.shm.pump(self, block=True)


def store(host, out) -> None:
    if is_device(out):
        from_host(host, out)
    else:
        np.copyto(out, host)


def host_copy(x) -> np.ndarray:
    """A device array's contents in a new host array."""
    host = np.empty(x.shape, x.dtype)
    to_host(x, host)
    return host


def describe(rows) -> str:
    """The header rows as text: 'rank 0: call 3, allreduce sum of 800 bytes float64; ...'."""
    kinds = {v: k for k, v in _KINDS.items()}
    ops = {v: k for k, v in _OPS.items()}
    registered = bool((rows[:, 6] >= 0).any())
    out = []
    for q, (call, kind, op, nbytes, num, _, win, off) in enumerate(rows.tolist()):
        name = _DTYPE_NAMES.get(num, f"dtype #{num}")
        where = (f" in registered window {win} at byte {off}" if win >= 0
                 else " (not a registered buffer)" if registered else "")
        out.append(f"rank {q}: call {call}, {kinds.get(kind, kind)} {ops.get(op, op)} of "
                   f"{nbytes} bytes {name}{where}")
    return "; ".join(out)
