"""Instrumented communication: the one place that hands arrays to MPI (DESIGN contract 6).

``Comm`` wraps one mpi4py communicator (one grid axis) of two or more ranks. Every operation
- uses the uppercase buffer methods (``Send``, ``Irecv``, ``Allreduce``...), never pickle;
- records one trace event ``"<axis>.<op>"`` with its payload bytes and, for point-to-point, the
  peer's world rank (non-blocking operations record the post, then ``"<axis>.wait"``);
- checks that a received message has exactly the expected byte count, so a shape or dtype
  disagreement between sender and receiver is an error, not silent garbage.

Device arrays are handed to MPI directly or staged through host buffers (``staging.py``);
``staging=True`` forces staging for NumPy arrays too, which is how the staged code path is tested
without a GPU. A group of one rank is a ``LocalComm`` (``local.py``), never a ``Comm``.

Import names from here: ``Comm``, ``LocalComm``, ``Request``, ``make_tag``, the tag constants and
``MessageSizeError`` (they live in the modules beside this one).
"""

from __future__ import annotations

import os

import numpy as np

from mpipar.mpi.common import (
    MAX_CHUNKS,
    MAX_MB,
    OFF,
    TAG_ACTIVATION,
    TAG_GRADIENT,
    TAG_LIMIT,
    MessageSizeError,
    check_contiguous,
    check_divisible,
    check_float,
    check_op,
    check_root,
    make_tag,
    norm_axis,
)
from mpipar.mpi.local import LocalComm
from mpipar.mpi.p2p import PointToPoint
from mpipar.mpi.requests import Request
from mpipar.mpi.staging import (
    POOL,
    cuda_aware,
    from_host,
    host_view,
    is_device,
    load_mpi,
    sync_device,
    to_host,
    xp_of,
)

__all__ = [
    "Comm", "LocalComm", "Request", "MessageSizeError", "make_tag", "TAG_ACTIVATION",
    "TAG_GRADIENT", "TAG_LIMIT", "MAX_CHUNKS", "MAX_MB",
]

MPI = None  # mpi4py.MPI, set when the first Comm is built


class Comm(PointToPoint):
    """One traced communicator of 2 or more ranks (a grid axis). See the module docstring."""

    def __init__(self, mpi_comm, axis, tracer=None, backend=None, world_ranks=None, staging=None):
        self.mpi = mpi_comm
        self.axis = str(axis)
        self.tracer = tracer if tracer is not None else OFF
        self.backend = backend
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        if self.size < 2:
            raise ValueError(
                f"{self.axis}: Comm needs a group of 2 or more ranks, got {self.size}; "
                f"a one-rank group is a LocalComm"
            )
        global MPI
        MPI = M = load_mpi()
        if world_ranks is None:
            world_ranks = M.Group.Translate_ranks(
                mpi_comm.Get_group(), list(range(self.size)), M.COMM_WORLD.Get_group()
            )
        self.world_ranks = [int(r) for r in world_ranks]
        if len(self.world_ranks) != self.size:
            raise ValueError(
                f"{len(self.world_ranks)} world ranks for a communicator of {self.size}"
            )
        # None: stage device arrays iff MPI is not CUDA-aware; True/False: always/never stage
        self.staging = staging
        if staging is None and os.environ.get("MPIPAR_FORCE_STAGING", "") == "1":
            self.staging = True
        self.wait_kind = f"{self.axis}.wait"  # the event a Request records on completion
        self._kinds = {}
        self._ops = {"sum": M.SUM, "mean": M.SUM, "max": M.MAX}

    # --- helpers ---------------------------------------------------------------------------

    def _stage(self, x) -> bool:
        if self.staging is not None:
            return bool(self.staging)
        return is_device(x) and not cuda_aware()

    def _begin(self, x):
        """Let x's producing GPU work finish (MPI and our timer both need that); start the clock."""
        if is_device(x):
            sync_device()
        return self.tracer.now()

    def _rec(self, op, start, mb=-1, chunk=-1, nbytes=0, peer=-1):
        kind = self._kinds.get(op)
        if kind is None:
            kind = self._kinds[op] = f"{self.axis}.{op}"
        # the per-message hot path: every value here is already an int / float
        self.tracer.record_now(kind, start, int(mb), int(chunk), int(nbytes), peer)

    def _op(self, op):
        check_op(op)
        return self._ops[op]

    def _peer(self, r, what):
        return self.world_ranks[check_root(self.axis, self.size, r, what)]

    def world_rank_of(self, local_rank) -> int:
        return self.world_ranks[local_rank]

    def free(self) -> None:
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi.Free()

    # --- collectives -----------------------------------------------------------------------

    def _in_out(self, call, xin, out) -> None:
        """call(send, recv) on xin and out directly, or on host copies when staging."""
        if not self._stage(xin):
            call(xin, out)
            return
        bin_, bout = POOL.acquire(xin.nbytes), POOL.acquire(out.nbytes)
        try:
            hin = host_view(bin_, xin.shape, xin.dtype)
            hout = host_view(bout, out.shape, out.dtype)
            to_host(xin, hin)
            call(hin, hout)
            from_host(hout, out)
        finally:
            POOL.release(bin_)
            POOL.release(bout)

    def allreduce(self, x, op="sum", inplace=False):
        """Elementwise reduction over the group; a new array, or x itself when ``inplace``."""
        mpi_op = self._op(op)
        if inplace:
            check_contiguous(x, f"{self.axis}.allreduce(inplace=True)")
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        xp = xp_of(x)
        out = x if inplace else xp.empty(x.shape, dtype=x.dtype)
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            try:
                host = host_view(buf, x.shape, x.dtype)
                to_host(x, host)
                self.mpi.Allreduce(MPI.IN_PLACE, host, mpi_op)
                from_host(host, out)
            finally:
                POOL.release(buf)
        elif inplace:
            self.mpi.Allreduce(MPI.IN_PLACE, x, mpi_op)
        else:
            self.mpi.Allreduce(xp.ascontiguousarray(x), out, mpi_op)
        if op == "mean":
            out /= self.size
        self._rec("allreduce", start, nbytes=x.nbytes)
        return out

    def iallreduce(self, x, op="sum") -> Request:
        """Post an in-place all-reduce of x; ``wait()`` returns x, reduced."""
        mpi_op = self._op(op)
        check_contiguous(x, f"{self.axis}.iallreduce")
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        stage = self._stage(x)
        buf = POOL.acquire(x.nbytes) if stage else None
        target = x
        if stage:
            target = host_view(buf, x.shape, x.dtype)
            to_host(x, target)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, target, mpi_op)
        size = self.size

        def finish(status):
            try:
                if stage:
                    from_host(target, x)
            finally:
                if buf is not None:
                    POOL.release(buf)
            if op == "mean":
                x[...] /= size
            return x

        self._rec("allreduce", start, nbytes=x.nbytes)
        return Request(self, req, finish, (-1, -1, x.nbytes, -1), keep=target)

    def allgather(self, x, axis=0):
        """Concatenation of every rank's x (all the same shape) along ``axis``, in rank order."""
        axis = norm_axis(axis, x.ndim)
        start = self._begin(x)
        xp = xp_of(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        out = xp.empty((self.size * xm.shape[0],) + xm.shape[1:], dtype=x.dtype)
        self._in_out(self.mpi.Allgather, xm, out)
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("allgather", start, nbytes=x.nbytes)
        return out

    def reduce_scatter(self, x, axis=0, op="sum"):
        """This rank's 1/size slice, along ``axis``, of the reduction of every rank's x."""
        mpi_op = self._op(op)
        axis = norm_axis(axis, x.ndim)
        check_divisible(self.axis, self.size, x, axis)
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        xp = xp_of(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        out = xp.empty((x.shape[axis] // self.size,) + xm.shape[1:], dtype=x.dtype)
        self._in_out(lambda s, r: self.mpi.Reduce_scatter_block(s, r, mpi_op), xm, out)
        if op == "mean":
            out /= self.size
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("reduce_scatter", start, nbytes=x.nbytes)
        return out

    def broadcast(self, x, root=0):
        """Overwrite x on every rank with root's x (in place); returns x."""
        self._peer(root, "root")
        check_contiguous(x, f"{self.axis}.broadcast")
        start = self._begin(x)
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            try:
                host = host_view(buf, x.shape, x.dtype)
                if self.rank == root:
                    to_host(x, host)
                self.mpi.Bcast([host, MPI.BYTE], root)
                if self.rank != root:
                    from_host(host, x)
            finally:
                POOL.release(buf)
        else:
            self.mpi.Bcast([x, MPI.BYTE], root)
        self._rec("broadcast", start, nbytes=x.nbytes)
        return x

    def allreduce_scalar(self, value: float, op="sum") -> float:
        mpi_op = self._op(op)
        start = self.tracer.now()
        buf = np.array([value], dtype=np.float64)
        self.mpi.Allreduce(MPI.IN_PLACE, buf, mpi_op)
        out = float(buf[0]) / (self.size if op == "mean" else 1)
        self._rec("allreduce", start, nbytes=8)
        return out

    def gather_bytes(self, data: bytes, root=0, *, trace=True):
        """Every rank's bytes (any lengths) as a list on ``root``; None elsewhere."""
        self._peer(root, "root")
        data = bytes(data)
        start = self.tracer.now()
        lengths = np.zeros(self.size, dtype=np.int64)
        self.mpi.Gather(np.array([len(data)], dtype=np.int64), lengths, root)
        result = None
        if self.rank == root:
            displs = np.zeros(self.size, dtype=np.int64)
            np.cumsum(lengths[:-1], out=displs[1:])
            out = np.empty(int(lengths.sum()), dtype=np.uint8)
            counts, offsets = [int(n) for n in lengths], [int(d) for d in displs]
            self.mpi.Gatherv([data, MPI.BYTE], [out, (counts, offsets), MPI.BYTE], root)
            raw = out.tobytes()
            result = [raw[d : d + n] for d, n in zip(offsets, counts, strict=True)]
        else:
            self.mpi.Gatherv([data, MPI.BYTE], None, root)
        if trace:
            self._rec("gather", start, nbytes=len(data))
        return result

    def broadcast_bytes(self, data: bytes | None, root=0, *, trace=True) -> bytes:
        """root's bytes on every rank (other ranks may pass None)."""
        self._peer(root, "root")
        start = self.tracer.now()
        n = np.array([len(data) if self.rank == root else 0], dtype=np.int64)
        self.mpi.Bcast(n, root)
        buf = np.frombuffer(bytes(data), dtype=np.uint8).copy() if self.rank == root else None
        if buf is None:
            buf = np.empty(int(n[0]), dtype=np.uint8)
        self.mpi.Bcast([buf, MPI.BYTE], root)
        if trace:
            self._rec("broadcast", start, nbytes=int(n[0]))
        return buf.tobytes()

    def barrier(self) -> None:
        start = self.tracer.now()
        self.mpi.Barrier()
        self._rec("barrier", start)
