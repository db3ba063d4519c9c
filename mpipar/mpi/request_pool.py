"""Grow the MPI library's request pool once, at set-up, instead of at a step nobody chose.

MPICH keeps a small array of request objects and, the first time more are alive at once,
allocates a block of 4,096 more (4,096 x 520 bytes = 2.03 MiB with MPICH 5.0's ch4 device here)
and keeps it to the end. Whether a run ever needs more than the first few depends on timing: a
rank that falls behind finds its partners' early messages waiting as unexpected requests beside
its own sends in flight. In the README's dp2 pp2 tp2 job on 2 shared cores under load (2 of 3
plain runs, 3 of 15 with an allocation tracer attached) one pipeline-first tensor-parallel pair
took the block at one step (32, 44, 68, 107, 110, 113 or 145), which raised the pair's measured
peak by 1.9-2.1 MiB: a quarter of it, and no part of what the config says
(``mpipar.training.memory``). An ``LD_PRELOAD`` malloc tracer
put the whole jump in one ``calloc(4096, 520)`` made inside a blocking ``MPI_Allreduce``; a
single rank posting 9 zero-byte receive/send pairs to itself (18 requests alive) makes the same
call (8 pairs do not).

``grow_request_pool`` makes that allocation during set-up, before the memory base is taken
(``training.memory.record_setup``): ``PAIRS`` matched zero-byte messages to itself on a private
duplicate of ``COMM_SELF``, alive together, then completed. Every rank then holds the block from
the start, as it holds the rest of the library's set-up memory, and a step's peak no longer
depends on whether this run happened to need it. It takes 1-2 ms once MPI is up (measured
here; the first communicator duplicate of a process costs more, whoever makes it) and sends
nothing to any other rank. With another MPI library it is the same few harmless messages to
itself (request free lists that grow in pieces are common; this one was measured with MPICH).
"""

from __future__ import annotations

PAIRS = 64  # 128 requests alive at once: well past MPICH's first block, far below its size


def grow_request_pool(mpi) -> None:
    """Have ``PAIRS`` receive/send pairs alive at once on a private self-communicator."""
    import numpy as np

    comm = mpi.COMM_SELF.Dup()
    try:
        empty = np.empty(0, dtype=np.uint8)
        reqs = [comm.Irecv(empty, source=0, tag=i) for i in range(PAIRS)]
        reqs += [comm.Isend(empty, dest=0, tag=i) for i in range(PAIRS)]
        mpi.Request.Waitall(reqs)
    finally:
        comm.Free()
