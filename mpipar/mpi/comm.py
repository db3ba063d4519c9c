"""Instrumented communication: the one place that hands arrays to MPI (docs/architecture.md,
"One place talks MPI").

``Comm`` wraps one mpi4py communicator (one grid axis) of two or more ranks. Every operation
- uses the uppercase buffer methods (``Send``, ``Irecv``, ``Allreduce``...), never pickle;
- records one trace event ``"<axis>.<op>"`` with its payload bytes and, for point-to-point, the
  peer's world rank (non-blocking operations record the post, then ``"<axis>.wait"``);
- checks that a received message has exactly the expected byte count, so a shape or dtype
  disagreement between sender and receiver is an error, not silent garbage.

``Comm`` is this module's small operations (broadcast, barrier, bytes, a scalar all-reduce) and
three mixins, each in its own module and each listing what it reads of ``Comm``: point-to-point
(``p2p.py``, each call with a fast branch for host arrays), all-reduce, reduce-scatter and
all-gather (``collectives.py``; the non-blocking ones in ``nonblocking.py``). A collective runs
the library's algorithm, a ring or Rabenseifner's (``algorithms.py``) or a shared window of one
node's ranks (``shm.py``), as ``MPIPAR_COLLECTIVES`` forces or ``tuning.py`` chooses; the
duplicate communicator and the shared windows they use are one object, ``Comm.windows``
(``windows.py``).

Device arrays are handed to MPI directly or staged through host buffers (``staging.py``);
``staging=True`` forces staging for NumPy arrays too, which is how the staged code path is tested
without a GPU. A group of one rank is a ``LocalComm`` (``local.py``), never a ``Comm``.

Both satisfy ``interface.Communicator``; import them, and the names beside them, from the package
(``from mpipar.mpi import Comm, LocalComm, make_tag``).
"""

from __future__ import annotations

import os

import numpy as np

from mpipar.mpi.collectives import Collectives
from mpipar.mpi.common import OFF, check_contiguous, check_op, check_root
from mpipar.mpi.nonblocking import NonBlocking
from mpipar.mpi.p2p import PointToPoint
from mpipar.mpi.staging import (
    POOL,
    cuda_aware,
    from_host,
    host_view,
    is_device,
    load_mpi,
    sync_device,
    to_host,
)
from mpipar.mpi.tuning import mode as collectives_mode
from mpipar.mpi.tuning import table as collectives_table
from mpipar.mpi.windows import Windows

MPI = None  # mpi4py.MPI, set when the first Comm is built
_OPS: dict = {}  # op name -> MPI.Op, set with it


class Comm(Collectives, NonBlocking, PointToPoint):
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
        global MPI, _OPS
        MPI = M = load_mpi()
        _OPS = {"sum": M.SUM, "mean": M.SUM, "max": M.MAX}
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
        self._fast = self.staging is not True  # NumPy arrays may go to MPI as they are
        self._algos_by_mode = {}  # see Collectives.coll_mode
        self.windows = Windows(mpi_comm, self.axis)
        self.coll_mode = collectives_mode()  # MPIPAR_COLLECTIVES: forced algorithm or "auto"
        if self.coll_mode == "auto":
            collectives_table()  # a broken table file fails here, before any traffic
        self._p2p_init(M)
        self._coll_init(M)

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
        return _OPS[op]

    def _peer(self, r, what):
        return self.world_ranks[check_root(self.axis, self.size, r, what)]

    def world_rank_of(self, local_rank) -> int:
        return self.world_ranks[local_rank]

    def shm_offered(self) -> bool:
        """Whether the shared-memory algorithm can run here (``Windows.shm_offered``)."""
        return self.windows.shm_offered()

    def registered_zeros(self, sizes, dtype, xp=None) -> list:
        """Zeroed 1-D arrays of ``sizes`` elements of ``dtype``, registered in a shared window
        where the ranks share a node (``Windows.registered_zeros``). Collective."""
        arrays = self.windows.registered_zeros(sizes, dtype, np if xp is None else xp)
        self._regs = self.windows.regs  # the collectives' hot "any registered buffer?" test
        return arrays

    def free(self) -> None:
        self.windows.free()  # the collectives' shared windows and duplicate communicator
        self._regs = ()
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi.Free()

    # --- collectives -----------------------------------------------------------------------

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
