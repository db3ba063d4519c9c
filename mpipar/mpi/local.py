"""``LocalComm``: the one representation of a grid axis of size 1 (no MPI at all).

``ProcessGrid`` hands one out for every axis of size 1 (and for the world of a one-rank run), so
callers never test for ``None``: code that must skip work when an axis is not split tests
``comm.size > 1``. Every collective keeps ``Comm``'s semantics for one rank: ``allreduce``,
``allgather`` and ``reduce_scatter`` return a new array (or x itself for ``inplace=True``),
``iallreduce`` and ``broadcast`` return x itself, ``ireduce_scatter`` fills ``out``,
``gather_bytes`` / ``broadcast_bytes`` return this rank's bytes. Arguments are checked as
``Comm`` checks them; nothing is recorded, since nothing is communicated. Point-to-point
raises: a one-rank group has no peer. Like ``Comm`` it implements ``interface.Communicator``,
and nothing more.
"""

from __future__ import annotations

from mpipar.mpi.common import (
    OFF,
    check_contiguous,
    check_divisible,
    check_op,
    check_root,
    norm_axis,
)
from mpipar.mpi.requests import Request


class LocalComm:
    """A one-rank group; ``world_rank`` is this process's world rank (0 outside a grid)."""

    size = 1
    rank = 0

    def __init__(self, axis="local", tracer=None, backend=None, world_rank=0):
        self.axis = str(axis)
        self.tracer = tracer if tracer is not None else OFF
        self.backend = backend
        self.world_ranks = [int(world_rank)]

    def world_rank_of(self, local_rank) -> int:
        check_root(self.axis, 1, local_rank, "local")
        return self.world_ranks[0]

    def _no_peer(self, op):
        raise RuntimeError(
            f"{self.axis}.{op}: a one-rank communicator has no peer to talk to; "
            f"point-to-point needs a group of 2 or more ranks"
        )

    # --- point to point: no peer -------------------------------------------------------------

    def send(self, x, dest, tag, *, mb=-1, chunk=-1):
        self._no_peer("send")

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        self._no_peer("recv")

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1):
        self._no_peer("isend")

    def irecv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        self._no_peer("irecv")

    # --- collectives: identity or copy -------------------------------------------------------

    def registered_zeros(self, sizes, dtype, xp=None) -> list:
        """Plain zeroed arrays (``Comm.registered_zeros`` registers them in a shared window; a
        one-rank group reduces nothing)."""
        import numpy as np

        xp = np if xp is None else xp
        return [xp.zeros(int(n), dtype=dtype) for n in sizes]

    def allreduce(self, x, op="sum", inplace=False):
        check_op(op)
        if inplace:
            check_contiguous(x, f"{self.axis}.allreduce(inplace=True)")
            return x
        return x.copy()

    def iallreduce(self, x, op="sum") -> Request:
        check_op(op)
        check_contiguous(x, f"{self.axis}.iallreduce")
        return Request(result=x)

    def ireduce_scatter(self, x, out, op="sum") -> Request:
        check_op(op)
        check_contiguous(x, f"{self.axis}.ireduce_scatter")
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"{self.axis}.ireduce_scatter: out is {tuple(out.shape)}, "
                             f"expected {tuple(x.shape)}")
        out[...] = x
        return Request(result=out)

    def allgather(self, x, axis=0, out=None):
        norm_axis(axis, x.ndim)
        if out is None:
            return x.copy()
        if axis % x.ndim != 0 or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"{self.axis}.allgather(out=...): out is {tuple(out.shape)}, "
                             f"expected {tuple(x.shape)} (and axis 0)")
        out[...] = x
        return out

    def reduce_scatter(self, x, axis=0, op="sum", out=None):
        check_op(op)
        check_divisible(self.axis, 1, x, norm_axis(axis, x.ndim))
        if out is None:
            return x.copy()
        if axis % x.ndim != 0 or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"{self.axis}.reduce_scatter(out=...): out is {tuple(out.shape)}, "
                             f"expected {tuple(x.shape)} (and axis 0)")
        out[...] = x
        return out

    def broadcast(self, x, root=0):
        check_root(self.axis, 1, root)
        check_contiguous(x, f"{self.axis}.broadcast")
        return x

    def allreduce_scalar(self, value: float, op="sum") -> float:
        check_op(op)
        return float(value)

    def gather_bytes(self, data: bytes, root=0, *, trace=True):
        check_root(self.axis, 1, root)
        return [bytes(data)]

    def broadcast_bytes(self, data, root=0, *, trace=True) -> bytes:
        check_root(self.axis, 1, root)
        return bytes(data)

    def barrier(self) -> None:
        pass

    def free(self) -> None:
        pass
