"""A posted non-blocking operation of a ``Comm`` (or an already finished one of ``LocalComm``)."""

from __future__ import annotations

from time import perf_counter as _now

from mpipar.mpi.staging import load_mpi


class Request:
    """A posted non-blocking operation; ``wait()`` returns the received / reduced array, or None.

    ``Request(result=x)`` is one that is already done (what a one-rank group hands out).
    """

    __slots__ = ("_comm", "_req", "_finish", "_info", "_keep", "_done", "_result", "_expect")

    def __init__(self, comm=None, req=None, finish=None, info=None, keep=None, result=None,
                 expect=None):
        self._comm = comm
        self._req = req
        self._finish = finish  # finish(status) -> result, run once on completion
        self._info = info  # (mb, chunk, nbytes, peer) for the wait event
        self._keep = keep  # the send buffer, kept alive until completion
        self._done = req is None
        self._result = result  # what wait() returns (finish's return value when given)
        self._expect = expect  # (shape, dtype, tag) of a receive: its byte count is checked

    @property
    def done(self) -> bool:
        """Known to be complete (``test`` or ``wait`` saw it finish)."""
        return self._done

    def wait(self):
        if self._done:
            return self._result
        MPI = load_mpi()
        comm = self._comm
        start = comm.tracer.now()
        status = comm._status  # one reused Status per communicator
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
        status = comm._status  # one reused Status per communicator
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
        comm = self._comm
        mb, chunk, nbytes, peer = self._info
        if self._expect is not None:
            shape, dtype, tag = self._expect
            comm._check_count(status, nbytes, shape, dtype, mb, chunk, peer, tag)
        if self._finish is not None:
            self._result = self._finish(status)
        self._keep = None
        comm.tracer.record_now(comm.wait_kind, start, mb, chunk, nbytes, peer)


class P2PRequest(Request):
    """A fast-branch ``isend`` / ``irecv`` of a host array (``p2p.py``): no finish callback, the
    byte count of a receive checked inline, ``MPI`` looked up only when an error needs it.

    ``_result`` is the receive buffer (what ``wait`` returns), None for a send; ``_keep`` holds
    the array MPI reads or writes until completion; ``_info`` is (mb, chunk, nbytes, peer).
    """

    __slots__ = ("_tag",)

    def __init__(self, comm, req, keep, result, info, tag):  # noqa: D107 (positional: hot path)
        self._comm = comm
        self._req = req
        self._keep = keep
        self._result = result
        self._info = info
        self._tag = tag
        self._done = False

    def wait(self):
        if self._done:
            return self._result
        comm = self._comm
        tr = comm.tracer
        start = _now()
        status = comm._status
        try:
            self._req.Wait(status)
        except load_mpi().Exception as exc:  # evaluated only when something was raised
            self._done = True
            raise comm.mpi_error(exc, "wait", *self._info) from exc
        self._end(comm, tr, status, start)
        return self._result

    def test(self) -> bool:
        if self._done:
            return True
        comm = self._comm
        status = comm._status
        try:
            flag = self._req.Test(status)
        except load_mpi().Exception as exc:
            self._done = True
            raise comm.mpi_error(exc, "wait", *self._info) from exc
        if flag:
            self._end(comm, comm.tracer, status, _now())
        return flag

    def _end(self, comm, tr, status, start) -> None:
        """Completion: the byte count checked, the buffer released, the wait event appended
        (``start``: a ``perf_counter`` reading; the trace list's ``append`` straight, as in
        ``p2p.py``: this is the pipeline's per-message path)."""
        self._done = True
        self._keep = None
        mb, chunk, nbytes, peer = self._info
        out = self._result
        if out is not None and status.Get_count(comm._BYTE) != nbytes:
            comm._check_count(status, nbytes, out.shape, out.dtype, mb, chunk, peer, self._tag)
        if comm._sink is not None:
            t0 = tr.t0
            comm._sink((comm.wait_kind, tr.step, mb, chunk, start - t0, _now() - t0, nbytes, peer))
