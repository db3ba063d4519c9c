"""Point-to-point messages of a ``Comm``: blocking and non-blocking, checked byte counts.

A mixin: ``Comm`` (``comm.py``) supplies ``mpi``, ``axis``, ``backend``, ``_peer``, ``_begin``,
``_stage`` and ``_rec``. Tags come from ``make_tag``; a received message must have exactly the
byte count the receiver expects, so a shape or dtype disagreement is an error, not garbage.

The methods here are the general path (device arrays, staging, bad arguments and their error
messages). A C-contiguous NumPy array to a valid peer and tag takes the fast path instead:
closures that ``fastp2p.bind`` installs on each instance at construction (``_fast_init``), over
everything a message needs looked up once, so a small message costs little more than the MPI
call and its trace event.
"""

from __future__ import annotations

import numpy as np

from mpipar.mpi import fastp2p
from mpipar.mpi.common import TAG_LIMIT, MessageSizeError, check_contiguous
from mpipar.mpi.requests import Request
from mpipar.mpi.staging import POOL, from_host, host_view, load_mpi, to_host


class PointToPoint:
    """send / recv / isend / irecv over ``self.mpi``, staged through host buffers when asked."""

    def _fast_init(self, MPI) -> None:
        """Hoist what every message needs out of the per-call path (called by ``__init__``)."""
        self._MPI, self._BYTE = MPI, MPI.BYTE
        self._peer_of = dict(enumerate(self.world_ranks))  # local rank -> world rank
        self._fast = self.staging is not True  # NumPy arrays go to MPI as they are
        self._status = MPI.Status()  # one per communicator: ranks are single-threaded
        self._sink = self.tracer.sink()  # the trace list's append, None when tracing is off
        self._k_send, self._k_recv = f"{self.axis}.send", f"{self.axis}.recv"
        fastp2p.bind(self, MPI)  # the per-instance fast send/recv/isend/irecv

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
        """Blocking send (the instance's fast closure from ``fastp2p`` takes host arrays)."""
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
        return self._recv_general(shape, dtype, source, tag, mb, chunk, xp, out)

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
        return self._irecv_general(shape, dtype, source, tag, mb, chunk, xp, out)

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
