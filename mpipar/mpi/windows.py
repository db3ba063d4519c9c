"""What a ``Comm``'s collectives own beside the communicator: the duplicate communicator the
algorithms talk on, the shared window of ``shm.py`` (made when first asked for), and registered
buffers, arrays that live in a shared window (``shm_registered.py``). One ``Windows`` per
``Comm`` (``Comm.windows``), freed with it.

Where the shared-memory algorithm is offered (every rank on one node) and the arrays are host
memory, the arrays are registered: one shared window holds them at the same offsets in every
rank's segment, and an all-reduce (in place) or reduce-scatter (axis 0) of one of them, or of a
contiguous view inside one, chooses from its own rows (``tuning.REGISTERED``) and, where that is
shm, reduces without copying it in or out. Where the ranks span nodes and ``hierarchical.py``
is offered, each node's ranks share a window of their own the same way, and its all-reduce
reduces them there with no copy before the node's leader talks across. Everywhere else (one
rank per node, no shared windows, device arrays, or a node's /dev/shm without room for the
window: ``_room``) the arrays are plain zeros and everything works as for any array:
callers never need to know. They are registered whatever ``MPIPAR_COLLECTIVES`` forces (any
algorithm runs on them; commbench switches the mode between calls on the same buffers). They
replace the caller's own allocation: no extra memory.
The window is freed with the communicator (``Comm.free``): the arrays must not be used after.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np

from mpipar.mpi.hierarchical import Hier
from mpipar.mpi.shm import Shm
from mpipar.mpi.shm_registered import SHM_DIR, Registered, room_for, segment_bytes
from mpipar.mpi.staging import load_mpi


class Windows:
    """The duplicate communicator, the shared window's life, registered buffers."""

    def __init__(self, mpi_comm, axis):
        self.mpi = mpi_comm  # the Comm's communicator
        self.axis = axis
        self.rank = mpi_comm.Get_rank()
        self._dup = None  # the communicator the algorithms talk on (a Dup, made on first use)
        self.shm = None  # shm.Shm once asked for; False where the ranks span nodes
        self.hier = None  # hierarchical.Hier once asked for; False where not offered
        self.regs = ()  # the Shm's registered windows (its list, once one is made)
        self.reg_shm = None  # the Shm holding them: the group's, or across nodes each node's

    def shm_offered(self) -> bool:
        """Whether the shared-memory algorithm can run: every rank on this node. Collective the
        first time (every rank asks at the same call: the first collective choosing it)."""
        if self.shm is None:
            self.shm = Shm.create(self.dup()) or False
        return self.shm is not False

    def hier_offered(self) -> bool:
        """Whether the node-aware algorithm can run: the ranks span nodes, two or more on some
        node (``hierarchical.Hier.create``). Collective the first time, as ``shm_offered``."""
        if self.hier is None:
            self.hier = Hier.create(self.dup()) or False
        return self.hier is not False

    def dup(self):
        """The duplicate communicator (collective the first time: every rank reaches it at the
        same call)."""
        if self._dup is None:
            self._dup = self.mpi.Dup()
        return self._dup

    def free(self) -> None:
        """Free the shared windows (registered ones too) and the duplicate communicator
        (collective; ``Comm.free``)."""
        if self.shm:
            self.shm.free()
        if self.hier:
            self.hier.free()
        self.shm = self.hier = self.reg_shm = None
        self.regs = ()
        if self._dup is not None:
            self._dup.Free()
            self._dup = None

    def registered_zeros(self, sizes, dtype, xp=np) -> list:
        """Zeroed 1-D arrays of ``sizes`` elements of ``dtype``, registered where possible
        (module docstring). Collective: every rank calls it with the same sizes and dtype (a
        disagreement is the same error on every rank)."""
        sizes = [int(n) for n in sizes]
        dtype = np.dtype(dtype)
        if any(n < 0 for n in sizes):
            raise ValueError(f"{self.axis}.registered_zeros: negative size in {sizes}")
        if xp is not np:
            return [xp.zeros(n, dtype=dtype) for n in sizes]
        if self.shm_offered():
            shm = self.shm
        elif self.hier_offered():
            shm = self.hier.shm  # each node's ranks share a window; hierarchical.py reads it
        else:
            return [xp.zeros(n, dtype=dtype) for n in sizes]
        self._agree_sizes(sizes, dtype)
        if not self._room(segment_bytes(sizes, dtype) * shm.size):
            return [xp.zeros(n, dtype=dtype) for n in sizes]
        reg = Registered(shm.comm, sizes, dtype, len(shm.regs))
        shm.regs.append(reg)
        self.regs, self.reg_shm = shm.regs, shm
        return list(reg.arrays)

    def _room(self, nbytes) -> bool:
        """Whether every rank sees room for the window (``nbytes`` for all ranks, a quarter
        more for what else lives there) in the node's shared-memory file system (collective).
        A container's default /dev/shm is 64 MiB: there the buckets stay private memory (the
        reduction takes the other algorithms) instead of MPI failing to map the window."""
        MPI = load_mpi()
        ok = np.array([1 if room_for(nbytes + nbytes // 4) else 0], dtype=np.int64)
        self.dup().Allreduce(MPI.IN_PLACE, ok, MPI.MIN)  # every rank of the group
        if not ok[0] and self.rank == 0:
            print(f"[mpipar] {self.axis}: no room in {SHM_DIR} for {nbytes / 2**20:.1f} MiB of "
                  f"registered buffers: they stay private memory (the collectives copy); give "
                  f"the node's shared memory more room (e.g. docker --shm-size)",
                  file=sys.stderr, flush=True)
        return bool(ok[0])

    def _agree_sizes(self, sizes, dtype) -> None:
        """Every rank asked for the same arrays, or the same error on every rank."""
        MPI = load_mpi()
        mine = np.array([len(sizes), sum(sizes), zlib.crc32(np.array(sizes, np.int64).tobytes()),
                         dtype.num, dtype.itemsize], dtype=np.int64)
        lo, hi = mine.copy(), mine.copy()
        comm = self.dup()  # every rank of the group
        comm.Allreduce(MPI.IN_PLACE, lo, MPI.MIN)
        comm.Allreduce(MPI.IN_PLACE, hi, MPI.MAX)
        if (lo != hi).any():
            raise ValueError(f"{self.axis}.registered_zeros: the ranks asked for different "
                             f"arrays (here {len(sizes)} of {dtype.name}, {sum(sizes)} elements "
                             f"in all); every rank must pass the same sizes and dtype")

    def registered(self, x) -> bool:
        """x is (a contiguous view inside) one of the registered buffers."""
        return bool(self.regs) and self.reg_shm.locate(x) is not None
