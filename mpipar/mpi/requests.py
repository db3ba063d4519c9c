"""A posted non-blocking operation of a ``Comm`` (or an already finished one of ``LocalComm``)."""

from __future__ import annotations

from mpipar.mpi.staging import load_mpi


class Request:
    """A posted non-blocking operation; ``wait()`` returns the received / reduced array, or None.

    ``Request(result=x)`` is one that is already done (what a one-rank group hands out).
    """

    __slots__ = ("_comm", "_req", "_finish", "_info", "_keep", "_done", "_result")

    def __init__(self, comm=None, req=None, finish=None, info=None, keep=None, result=None):
        self._comm = comm
        self._req = req
        self._finish = finish  # finish(status) -> result, run once on completion
        self._info = info  # (mb, chunk, nbytes, peer) for the wait event
        self._keep = keep  # the send buffer, kept alive until completion
        self._done = req is None
        self._result = result

    def wait(self):
        if self._done:
            return self._result
        MPI = load_mpi()
        comm = self._comm
        start = comm.tracer.now()
        status = MPI.Status()
        try:
            self._req.Wait(status)
        except MPI.Exception as exc:
            self._done = True
            raise comm.mpi_error(exc, "wait", *self._info) from exc
        self._complete(status, start)
        return self._result

    def test(self) -> bool:
        """True when done (and then ``wait()`` returns at once)."""
        if self._done:
            return True
        MPI = load_mpi()
        comm = self._comm
        status = MPI.Status()
        try:
            flag = self._req.Test(status)
        except MPI.Exception as exc:
            self._done = True
            raise comm.mpi_error(exc, "wait", *self._info) from exc
        if flag:
            self._complete(status, comm.tracer.now())
        return bool(flag)

    def _complete(self, status, start) -> None:
        self._done = True
        if self._finish is not None:
            self._result = self._finish(status)
        self._keep = None
        comm = self._comm
        mb, chunk, nbytes, peer = self._info
        comm.tracer.record(comm.wait_kind, start, comm.tracer.now(), mb, chunk, nbytes, peer)
