"""Point-to-point messages of a ``Comm``: blocking and non-blocking, checked byte counts.

A mixin: ``Comm`` (``comm.py``) supplies ``mpi``, ``axis``, ``backend``, ``tracer``, ``_peer``,
``_begin``, ``_stage`` and ``_rec``, and calls ``_p2p_init`` once. Tags come from ``make_tag``;
a received message must have exactly the byte count the receiver expects, so a shape or dtype
disagreement is an error, not garbage.

Each operation is one method with two branches. A NumPy array, C-contiguous, to or from a known
peer with a valid tag (and for a receive an ``out`` of exactly the expected shape and dtype, or
none and host memory wanted) takes the first: a small message costs the MPI call plus whatever
Python runs around it, and that Python is most of its time (~1.8 us raw one-way here), so this
branch reads what ``_p2p_init`` looked up once (the peer table, the trace list's ``append``, the
event names, one reused ``Status``), checks only what protects the data (C order: MPI would send
an F-ordered array in memory order; the received byte count: a shorter message would leave stale
bytes) and appends the trace event tuple ``Tracer.record_now`` would, directly (``Tracer.sink``,
``t0`` read per message since ``reset_clock`` moves it). Everything else (device arrays, staging,
a misfit ``out``, bad arguments) takes the ``_general`` branch, which also says what is wrong.

Plain methods on purpose: a callable stored on the instance under a method's name defeats
CPython's method-call specialisation at every call site, and that costs more than reading the
hoisted values from ``self``.
"""

from __future__ import annotations

from time import perf_counter as _now

import numpy as np

from mpipar.mpi.common import TAG_LIMIT, MessageSizeError, check_contiguous
from mpipar.mpi.requests import P2PRequest, Request
from mpipar.mpi.staging import POOL, from_host, host_view, load_mpi, to_host

_ndarray = np.ndarray


def _host_target(shape, dtype, xp, out, host_only):
    """The host array a fast receive writes into; None sends the call to the general branch
    (device memory wanted, or an ``out`` that does not fit: the general branch says why)."""
    if out is None:
        return np.empty(shape, dtype=dtype) if xp is np or (xp is None and host_only) else None
    if (type(out) is _ndarray and out.shape == shape
            and (out.dtype is dtype or out.dtype == dtype) and out.flags.c_contiguous):
        return out
    return None


class PointToPoint:
    """send / recv / isend / irecv over ``self.mpi``, staged through host buffers when asked."""

    def _p2p_init(self, MPI) -> None:
        """Hoist what every message needs out of the per-message path (``Comm.__init__``)."""
        self._BYTE = MPI.BYTE
        # local rank -> world rank of the peers a message may take the fast branch to: none
        # when staging is forced (every message is then staged, so goes the general way)
        self._fast_peers = {} if self.staging is True else dict(enumerate(self.world_ranks))
        self._status = MPI.Status()  # one per communicator: ranks are single-threaded
        self._sink = self.tracer.sink()  # the trace list's append, None when tracing is off
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
        got = status.Get_count(self._BYTE)
        if got != nbytes:
            raise MessageSizeError(
                f"{self.axis}.recv from world rank {peer} (tag {tag}, mb {mb}, chunk {chunk}): "
                f"expected {nbytes} bytes ({tuple(shape)} {np.dtype(dtype).name}) but the message "
                f"has {got} bytes; sender and receiver disagree on the shape or dtype"
            )

    # --- the four operations ----------------------------------------------------------------

    def send(self, x, dest, tag, *, mb=-1, chunk=-1) -> None:
        """Blocking send of x to local rank ``dest``."""
        peer = self._fast_peers.get(dest)
        if (peer is None or type(x) is not _ndarray or not 0 <= tag < TAG_LIMIT
                or not x.flags.c_contiguous):
            return self._send_general(x, dest, tag, mb, chunk)
        append = self._sink
        if append is None:
            self.mpi.Send([x, self._BYTE], dest, tag)
            return None
        start = _now()
        self.mpi.Send([x, self._BYTE], dest, tag)
        tr = self.tracer
        t0 = tr.t0
        append((self._k_send, tr.step, mb, chunk, start - t0, _now() - t0, x.nbytes, peer))
        return None

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        """Receive into a new array, or into ``out`` (reuse avoids fresh-memory page faults)."""
        peer = self._fast_peers.get(source)
        buf = (_host_target(shape, dtype, xp, out, self.backend is None)
               if peer is not None and 0 <= tag < TAG_LIMIT else None)
        if buf is None:
            return self._recv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        append = self._sink
        start = _now() if append is not None else 0.0
        status = self._status
        try:
            self.mpi.Recv([buf, self._BYTE], source, tag, status)
        except load_mpi().Exception as exc:  # evaluated only when something was raised
            raise self.mpi_error(exc, "recv", mb, chunk, buf.nbytes, peer) from exc
        n = buf.nbytes
        if status.Get_count(self._BYTE) != n:
            self._check_count(status, n, shape, dtype, mb, chunk, peer, tag)
        if append is not None:
            tr = self.tracer
            t0 = tr.t0
            append((self._k_recv, tr.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return buf

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1) -> Request:
        """Post a send; x must stay alive and unchanged until ``wait`` (staging copies it now)."""
        peer = self._fast_peers.get(dest)
        if (peer is None or type(x) is not _ndarray or not 0 <= tag < TAG_LIMIT
                or not x.flags.c_contiguous):
            return self._isend_general(x, dest, tag, mb, chunk)
        n = x.nbytes
        append = self._sink
        if append is None:
            return P2PRequest(self, self.mpi.Isend([x, self._BYTE], dest, tag), x, None,
                              (mb, chunk, n, peer), tag)
        start = _now()
        req = self.mpi.Isend([x, self._BYTE], dest, tag)
        tr = self.tracer
        t0 = tr.t0
        append((self._k_send, tr.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return P2PRequest(self, req, x, None, (mb, chunk, n, peer), tag)

    def irecv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None) -> Request:
        """Post a receive; ``wait()`` returns the new array (or ``out``, filled)."""
        peer = self._fast_peers.get(source)
        if peer is None or not 0 <= tag < TAG_LIMIT:
            buf = None
        elif (type(out) is _ndarray and out.shape == shape  # _host_target's common case,
              and (out.dtype is dtype or out.dtype == dtype)  # written out: the pipeline
              and out.flags.c_contiguous):  # posts one per micro-batch
            buf = out
        else:
            buf = _host_target(shape, dtype, xp, out, self.backend is None)
        if buf is None:
            return self._irecv_general(shape, dtype, source, tag, mb, chunk, xp, out)
        n = buf.nbytes
        append = self._sink
        if append is None:
            return P2PRequest(self, self.mpi.Irecv([buf, self._BYTE], source, tag), buf, buf,
                              (mb, chunk, n, peer), tag)
        start = _now()
        req = self.mpi.Irecv([buf, self._BYTE], source, tag)
        tr = self.tracer
        t0 = tr.t0
        append((self._k_recv, tr.step, mb, chunk, start - t0, _now() - t0, n, peer))
        return P2PRequest(self, req, buf, buf, (mb, chunk, n, peer), tag)

    # --- the general branch: device arrays, staging, and the error messages ------------------

    def _send_buffer(self, x):
        """(buffer handed to MPI, pool buffer to release or None)."""
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            host = host_view(buf, x.shape, x.dtype)
            to_host(x, host)
            return host, buf
        check_contiguous(x, f"{self.axis}.send")
        return x, None

    def _send_general(self, x, dest, tag, mb, chunk) -> None:
        peer = self._peer(dest, "destination")
        self._check_tag(tag)
        start = self._begin(x)
        data, buf = self._send_buffer(x)
        try:
            self.mpi.Send([data, self._BYTE], dest, tag)
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

    def _isend_general(self, x, dest, tag, mb, chunk) -> Request:
        peer = self._peer(dest, "destination")
        self._check_tag(tag)
        start = self._begin(x)
        data, buf = self._send_buffer(x)
        req = self.mpi.Isend([data, self._BYTE], dest, tag)

        def finish(status):
            if buf is not None:
                POOL.release(buf)
            return None

        self._rec("send", start, mb, chunk, x.nbytes, peer)
        return Request(self, req, finish, (mb, chunk, x.nbytes, peer), keep=(x, data))

    def _irecv_general(self, shape, dtype, source, tag, mb, chunk, xp, out) -> Request:
        peer = self._peer(source, "source")
        self._check_tag(tag)
        out = self._recv_target(shape, dtype, xp, out)
        start = self._begin(out)
        stage = self._stage(out)
        buf = POOL.acquire(out.nbytes) if stage else None
        target = host_view(buf, out.shape, out.dtype) if stage else out
        req = self.mpi.Irecv([target, self._BYTE], source, tag)
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
