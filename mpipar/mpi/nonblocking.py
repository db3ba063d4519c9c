"""Non-blocking all-reduce and reduce-scatter of a ``Comm`` (the data-parallel buckets).

A mixin beside ``Collectives`` (``collectives.py``), whose algorithm choice, scratch buffers and
step generators it uses. A posted collective advances whenever ``algorithms.progress()`` (the
executor, between actions) or its request's ``test()`` runs, and finishes at ``wait()``. The
shared-memory algorithm (``shm.py``) advances the same way, a barrier per step; one runs at a
time per communicator: the steps' barriers are Ibarriers on one communicator, which match in the
order posted, not by collective, so with two running rank 0 could pass bucket 2's first barrier
matched against rank 1's closing barrier of bucket 1, and read bucket 2 of rank 1 while rank 1's
backward still writes it. Posting a copying one finishes the one before; a registered buffer's
(``shm_registered.py``: no window to grow) is queued instead and starts when the one before it
ends, at a later ``progress()``, ``test()`` or ``wait()``: posting a bucket during the backward
never blocks it.
"""

from __future__ import annotations

from mpipar.mpi import algorithms as alg
from mpipar.mpi.common import check_contiguous, check_divisible, check_float
from mpipar.mpi.requests import Request
from mpipar.mpi.staging import POOL, from_host, host_view, load_mpi, to_host


class NonBlocking:
    """iallreduce / ireduce_scatter, by the library or a stepped algorithm."""

    def iallreduce(self, x, op="sum") -> Request:
        """Post an in-place all-reduce of x; ``wait()`` returns x, reduced. It advances whenever
        ``algorithms.progress()`` (the executor, between actions) or ``test()`` runs."""
        mpi_op = self._op(op)
        check_contiguous(x, f"{self.axis}.iallreduce")
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        registered = self._registered(x)
        algo = self.algorithm_for("allreduce", x.nbytes, x, registered)
        stage = self._stage(x) and algo != "shm"  # shm copies device memory itself
        buf = POOL.acquire(x.nbytes) if stage else None
        target = x
        if stage:
            target = host_view(buf, x.shape, x.dtype)
            to_host(x, target)
        if algo == "library":
            req = self.mpi.Iallreduce(load_mpi().IN_PLACE, target, mpi_op)
        else:
            req = self._post(algo, self._allreduce_steps(algo, target.reshape(-1), op),
                             0 if registered else x.nbytes, registered)
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
        request = Request(self, req, finish, (-1, -1, x.nbytes, -1), keep=target)
        alg.PENDING[:] = [r for r in alg.PENDING if not r.done]
        alg.PENDING.append(request)
        return request

    def ireduce_scatter(self, x, out, op="sum") -> Request:
        """Post a reduce-scatter of contiguous x along axis 0 into ``out`` (this rank's
        x.shape[0] / size rows, contiguous); ``wait()`` returns out. x must stay unchanged until
        then. Advanced by ``algorithms.progress()``, like ``iallreduce``."""
        mpi_op = self._op(op)
        check_contiguous(x, f"{self.axis}.ireduce_scatter")
        check_contiguous(out, f"{self.axis}.ireduce_scatter(out)")
        check_divisible(self.axis, self.size, x, 0)
        want = (x.shape[0] // self.size,) + tuple(x.shape[1:])
        if tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"{self.axis}.ireduce_scatter: out is {tuple(out.shape)} "
                             f"{out.dtype}, expected {want} {x.dtype}")
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        registered = self._registered(x)
        algo = self.algorithm_for("reduce_scatter", x.nbytes, x, registered)
        stage = self._stage(x) and algo == "library"  # the others stage (or need not) inside
        bufs = [POOL.acquire(x.nbytes), POOL.acquire(out.nbytes)] if stage else []
        if algo != "library":
            # hier's reduce-scatter copies even a registered x (its node sum is a new array)
            zero_copy = registered and algo == "shm"
            req = self._post(algo, self._reduce_scatter_steps(algo, x, out, op),
                             0 if zero_copy else x.nbytes, zero_copy)
        elif stage:
            hin, hout = host_view(bufs[0], x.shape, x.dtype), host_view(bufs[1], want, x.dtype)
            to_host(x, hin)
            req = self.mpi.Ireduce_scatter_block(hin, hout, mpi_op)
        else:
            req = self.mpi.Ireduce_scatter_block(x, out, mpi_op)
        size = self.size

        def finish(status):
            try:
                if bufs and algo == "library":
                    from_host(host_view(bufs[1], want, x.dtype), out)
            finally:
                for b in bufs:
                    POOL.release(b)
            if op == "mean":
                out[...] /= size
            return out

        self._rec("reduce_scatter", start, nbytes=x.nbytes)
        request = Request(self, req, finish, (-1, -1, x.nbytes, -1), keep=(x, out))
        alg.PENDING[:] = [r for r in alg.PENDING if not r.done]
        alg.PENDING.append(request)
        return request
