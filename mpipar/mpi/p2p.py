"""Point-to-point messages of a ``Comm``: blocking and non-blocking, checked byte counts.

A mixin: ``Comm`` (``comm.py``) supplies ``mpi``, ``axis``, ``backend``, ``_peer``, ``_begin``,
``_stage`` and ``_rec``. Tags come from ``make_tag``; a received message must have exactly the
byte count the receiver expects, so a shape or dtype disagreement is an error, not garbage.

Fast path: a C-contiguous NumPy array, a valid peer and tag, no forced staging. Everything it
needs is looked up once (``_fast_init``: peer table, ``MPI.BYTE``, one reused ``Status``, the
trace kinds), so a small message costs the MPI call, one tuple for the trace event and, for the
non-blocking calls, one ``Request``. Anything else (device arrays, staging, bad arguments) takes
the general path, which also produces the error messages.
"""

from __future__ import annotations

from time import perf_counter as _now

import numpy as np

from mpipar.mpi.common import TAG_LIMIT, MessageSizeError, check_contiguous
from mpipar.mpi.requests import P2PRequest, Request
from mpipar.mpi.staging import POOL, from_host, host_view, load_mpi, to_host

_ndarray = np.ndarray
_BYTE = _MPIException = None  # MPI.BYTE and MPI.Exception, set by the first Comm


class PointToPoint:
    """send / recv / isend / irecv over ``self.mpi``, staged through host buffers when asked."""

    def _fast_init(self, MPI) -> None:
        """Hoist what every message needs out of the per-call path (called by ``__init__``)."""
        global _BYTE, _MPIException
        _BYTE, _MPIException = MPI.BYTE, MPI.Exception
        self._MPI, self._BYTE = MPI, MPI.BYTE
        # the peer table is empty when staging is forced: every message then takes the general
        # path (one dict lookup decides, instead of a flag and a lookup)
        self._peer_of = dict(enumerate(self.world_ranks)) if self.staging is not True else {}
        self._fast = self.staging is not True  # NumPy arrays go to MPI as they are
        self._status = MPI.Status()  # one per communicator: ranks are single-threaded
        self._k_send, self._k_recv = f"{self.axis}.send", f"{self.axis}.recv"

    @staticmethod
    def _check_tag(tag):
        if not 0 <= int(tag) < TAG_LIMIT:
            raise ValueError(f"tag {tag} must be in 0..{TAG_LIMIT - 1} (use make_tag)")

    def mpi_error(self, exc, op, mb, chunk, nbytes, peer):
        """The exception to raise for an MPI error of a receive (a truncation says why)."""
        MPI = load_mpi()
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return MessageSizeError(
                f"{self.axis}.{op} from world rank {peer} (mb {mb}, chunk {chunk}): the message is "
                f"larger than the expected {nbytes} bytes; sender and receiver disagree on the "
                f"shape or dtype"
            )
        return exc

    def _check_count(self, status, nbytes, shape, dtype, mb, chunk, peer, tag):
        MPI = load_mpi()
        got = status.Get_count(MPI.BYTE)
        if got != nbytes:
            raise MessageSizeError(
                f"{self.axis}.recv from world rank {peer} (tag {tag}, mb {mb}, chunk {chunk}): "
                f"expected {nbytes} bytes ({tuple(shape)} {np.dtype(dtype).name}) but the message "
                f"has {got} bytes; sender and receiver disagree on the shape or dtype"
            )

    # --- messages ---------------------------------------------------------------------------

    def _send_buffer(self, x):
        """(buffer handed to MPI, pool buffer to release or None)."""
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            host = host_view(buf, x.shape, x.dtype)
            to_host(x, host)
            return host, buf
        check_contiguous(x, f"{self.axis}.send")
        return x, None

    def send(self, x, dest, tag, *, mb=-1, chunk=-1) -> None:
        peer = self._peer_of.get(dest)
        if (peer is not None and type(x) is _ndarray and 0 <= tag < TAG_LIMIT
                and x.flags.c_contiguous):
            tr = self.tracer
            start = _now() - tr.t0
            self.mpi.Send([x, _BYTE], dest, tag)
            tr.record_now(self._k_send, start, mb, chunk, x.nbytes, peer)
            return
        self._send_general(x, dest, tag, mb, chunk)

    def _send_general(self, x, dest, tag, mb, chunk) -> None:
        MPI = load_mpi()
        peer = self._peer(dest, "destination")
        self._check_tag(tag)
        start = self._begin(x)
        data, buf = self._send_buffer(x)
        try:
            self.mpi.Send([data, MPI.BYTE], dest, tag)
        finally:
            if buf is not None:
                POOL.release(buf)
        self._rec("send", start, mb, chunk, x.nbytes, peer)

    def _recv_target(self, shape, dtype, xp, out):
        """A fresh array to receive into, or the caller's ``out`` after checking it fits."""
        if out is None:
            xp = xp if xp is not None else (self.backend.xp if self.backend is not None else np)
            return xp.empty(shape, dtype=dtype)
        if tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype):
            raise ValueError(
                f"{self.axis}.recv: out has shape {tuple(out.shape)} {out.dtype}, "
                f"expected {tuple(shape)} {np.dtype(dtype)}"
            )
        check_contiguous(out, f"{self.axis}.recv(out=...)")
        return out

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        """Receive into a new array, or into ``out`` (reuse avoids fresh-memory page faults)."""
        peer = self._peer_of.get(source)
        if peer is not None and 0 <= tag < TAG_LIMIT:
            if out is None:
                if xp is np or xp is None and self.backend is None:
                    out = np.empty(shape, dtype=dtype)
                else:
                    peer = None
            elif not (type(out) is _ndarray and out.shape == shape
                      and (out.dtype is dtype or out.dtype == dtype)
                      and out.flags.c_contiguous):
                peer = None  # the general path takes (and explains) a misfit out
        if peer is None:
            return self._recv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        tr = self.tracer
        start = _now() - tr.t0
        status = self._status
        try:
            self.mpi.Recv([out, _BYTE], source, tag, status)
        except _MPIException as exc:
            raise self.mpi_error(exc, "recv", mb, chunk, out.nbytes, peer) from exc
        n = out.nbytes
        if status.Get_count(_BYTE) != n:
            self._check_count(status, n, shape, dtype, mb, chunk, peer, tag)
        tr.record_now(self._k_recv, start, mb, chunk, n, peer)
        return out

    def _recv_general(self, shape, dtype, source, tag, mb, chunk, xp, out):
        MPI = load_mpi()
        peer = self._peer(source, "source")
        self._check_tag(tag)
        out = self._recv_target(shape, dtype, xp, out)
        start = self._begin(out)  # the pool may reuse memory a queued kernel still writes
        stage = self._stage(out)
        buf = POOL.acquire(out.nbytes) if stage else None
        target = host_view(buf, out.shape, out.dtype) if stage else out
        status = MPI.Status()
        try:
            try:
                self.mpi.Recv([target, MPI.BYTE], source, tag, status)
            except MPI.Exception as exc:
                raise self.mpi_error(exc, "recv", mb, chunk, out.nbytes, peer) from exc
            self._check_count(status, out.nbytes, shape, dtype, mb, chunk, peer, tag)
            if stage:
                from_host(target, out)
        finally:
            if buf is not None:
                POOL.release(buf)
        self._rec("recv", start, mb, chunk, out.nbytes, peer)
        return out

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1) -> Request:
        """Post a send; x must stay alive and unchanged until ``wait`` (staging copies it now)."""
        peer = self._peer_of.get(dest)
        if (peer is not None and type(x) is _ndarray and 0 <= tag < TAG_LIMIT
                and x.flags.c_contiguous):
            tr = self.tracer
            start = _now() - tr.t0
            req = self.mpi.Isend([x, _BYTE], dest, tag)
            n = x.nbytes
            tr.record_now(self._k_send, start, mb, chunk, n, peer)
            return P2PRequest(self, req, x, None, (mb, chunk, n, peer), tag)
        return self._isend_general(x, dest, tag, mb, chunk)

    def _isend_general(self, x, dest, tag, mb, chunk) -> Request:
        MPI = load_mpi()
        peer = self._peer(dest, "destination")
        self._check_tag(tag)
        start = self._begin(x)
        data, buf = self._send_buffer(x)
        req = self.mpi.Isend([data, MPI.BYTE], dest, tag)

        def finish(status):
            if buf is not None:
                POOL.release(buf)
            return None

        self._rec("send", start, mb, chunk, x.nbytes, peer)
        return Request(self, req, finish, (mb, chunk, x.nbytes, peer), keep=(x, data))

    def irecv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None) -> Request:
        """Post a receive; ``wait()`` returns the new array (or ``out``, filled)."""
        peer = self._peer_of.get(source)
        if peer is not None and 0 <= tag < TAG_LIMIT:
            if out is None:
                if xp is np or xp is None and self.backend is None:
                    out = np.empty(shape, dtype=dtype)
                else:
                    peer = None
            elif not (type(out) is _ndarray and out.shape == shape
                      and (out.dtype is dtype or out.dtype == dtype)
                      and out.flags.c_contiguous):
                peer = None  # the general path takes (and explains) a misfit out
        if peer is None:
            return self._irecv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        tr = self.tracer
        start = _now() - tr.t0
        req = self.mpi.Irecv([out, _BYTE], source, tag)
        n = out.nbytes
        tr.record_now(self._k_recv, start, mb, chunk, n, peer)
        return P2PRequest(self, req, out, out, (mb, chunk, n, peer), tag)

    def _irecv_general(self, shape, dtype, source, tag, mb, chunk, xp, out) -> Request:
        MPI = load_mpi()
        peer = self._peer(source, "source")
        self._check_tag(tag)
        out = self._recv_target(shape, dtype, xp, out)
        start = self._begin(out)
        stage = self._stage(out)
        buf = POOL.acquire(out.nbytes) if stage else None
        target = host_view(buf, out.shape, out.dtype) if stage else out
        req = self.mpi.Irecv([target, MPI.BYTE], source, tag)
        nbytes = out.nbytes

        def finish(status):
            try:
                self._check_count(status, nbytes, shape, dtype, mb, chunk, peer, tag)
                if stage:
                    from_host(target, out)
            finally:
                if buf is not None:
                    POOL.release(buf)
            return out

        self._rec("recv", start, mb, chunk, nbytes, peer)
        return Request(self, req, finish, (mb, chunk, nbytes, peer), keep=target)
