"""The per-message fast path of ``Comm``'s point-to-point calls, as closures bound per instance.

Why closures: a small message costs the MPI call plus whatever Python runs around it, and that
Python is most of a small message's time (issue 18: ~1.8 us raw one-way here). Reading a closure
cell is the cheapest lookup CPython has; a method reads ``self.<x>`` for everything it needs. So
``bind(comm)`` builds ``send``, ``recv``, ``isend`` and ``irecv`` once per communicator, over
local copies of what every message needs (the MPI methods, the peer table, the trace list and
the event kinds), and installs them on the instance, where they shadow the class's methods.

What a closure handles: a NumPy array, C-contiguous, to or from a known peer with a valid tag,
and for a receive an ``out`` of exactly the expected shape and dtype (or none, for a fresh
array). Anything else (device arrays, staging, a misfit ``out``, bad arguments) goes to the
class's general path, which also produces the error messages. The checks that stay are the
ones that protect the data: C order (MPI would send an F-ordered array in memory order), and the
received byte count (a shorter message would leave stale bytes).

The trace event is the same tuple ``Tracer.record_now`` appends, appended directly to the
tracer's list (``Tracer.sink``), with ``t0`` read per message (``reset_clock`` moves it).
"""

from __future__ import annotations

from time import perf_counter as _now

import numpy as np

from mpipar.mpi.common import TAG_LIMIT
from mpipar.mpi.requests import P2PRequest

_ndarray = np.ndarray


def bind(comm, MPI) -> None:
    """Install the fast ``send``/``recv``/``isend``/``irecv`` on ``comm`` (a ``Comm``)."""
    if not comm._fast:
        return  # staging forced: every message takes the general path
    comm.send, comm.isend = _senders(comm, MPI)
    comm.recv, comm.irecv = _receivers(comm, MPI)


def _senders(comm, MPI):
    """(send, isend) closures for C-contiguous NumPy arrays."""
    tracer, append, peer_of = comm.tracer, comm._sink, comm._peer_of
    # getattr: a test's stand-in communicator may implement only the calls it exercises
    Send, Isend = getattr(comm.mpi, "Send", None), getattr(comm.mpi, "Isend", None)
    BYTE, kind = MPI.BYTE, comm._k_send
    send_general, isend_general = comm._send_general, comm._isend_general

    def send(x, dest, tag, *, mb=-1, chunk=-1):
        peer = peer_of.get(dest)
        if (peer is None or type(x) is not _ndarray or not 0 <= tag < TAG_LIMIT
                or not x.flags.c_contiguous):
            return send_general(x, dest, tag, mb, chunk)
        if append is None:
            Send([x, BYTE], dest, tag)
            return None
        start = _now()
        Send([x, BYTE], dest, tag)
        t0 = tracer.t0
        append((kind, tracer.step, mb, chunk, start - t0, _now() - t0, x.nbytes, peer))
        return None

    def isend(x, dest, tag, *, mb=-1, chunk=-1):
        peer = peer_of.get(dest)
        if (peer is None or type(x) is not _ndarray or not 0 <= tag < TAG_LIMIT
                or not x.flags.c_contiguous):
            return isend_general(x, dest, tag, mb, chunk)
        n = x.nbytes
        if append is None:
            return P2PRequest(comm, Isend([x, BYTE], dest, tag), x, None, (mb, chunk, n, peer), tag)
        start = _now()
        req = Isend([x, BYTE], dest, tag)
        t0 = tracer.t0
        append((kind, tracer.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return P2PRequest(comm, req, x, None, (mb, chunk, n, peer), tag)

    return send, isend


def _receivers(comm, MPI):
    """(recv, irecv) closures for a host ``out`` that fits the message, or a fresh host array."""
    tracer, append, peer_of = comm.tracer, comm._sink, comm._peer_of
    Recv, Irecv = getattr(comm.mpi, "Recv", None), getattr(comm.mpi, "Irecv", None)
    BYTE, MPIException, status, kind = MPI.BYTE, MPI.Exception, comm._status, comm._k_recv
    host_only = comm.backend is None  # no device backend: a fresh receive is a NumPy array
    recv_general, irecv_general = comm._recv_general, comm._irecv_general

    def target(shape, dtype, xp, out):
        """The host array to receive into; None sends the call to the general path (device
        memory wanted, or an ``out`` that does not fit: the general path says why)."""
        if out is None:
            return np.empty(shape, dtype=dtype) if xp is np or (xp is None and host_only) else None
        if (type(out) is _ndarray and out.shape == shape
                and (out.dtype is dtype or out.dtype == dtype) and out.flags.c_contiguous):
            return out
        return None

    def recv(shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        peer = peer_of.get(source)
        buf = target(shape, dtype, xp, out) if peer is not None and 0 <= tag < TAG_LIMIT else None
        if buf is None:
            return recv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        start = _now() if append is not None else 0.0
        try:
            Recv([buf, BYTE], source, tag, status)
        except MPIException as exc:
            raise comm.mpi_error(exc, "recv", mb, chunk, buf.nbytes, peer) from exc
        n = buf.nbytes
        if status.Get_count(BYTE) != n:
            comm._check_count(status, n, shape, dtype, mb, chunk, peer, tag)
        if append is not None:
            t0 = tracer.t0
            append((kind, tracer.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return buf

    def irecv(shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        peer = peer_of.get(source)
        buf = target(shape, dtype, xp, out) if peer is not None and 0 <= tag < TAG_LIMIT else None
        if buf is None:
            return irecv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        n = buf.nbytes
        if append is None:
            return P2PRequest(comm, Irecv([buf, BYTE], source, tag), buf, buf, (mb, chunk, n, peer),
                              tag)
        start = _now()
        req = Irecv([buf, BYTE], source, tag)
        t0 = tracer.t0
        append((kind, tracer.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return P2PRequest(comm, req, buf, buf, (mb, chunk, n, peer), tag)

    return recv, irecv
