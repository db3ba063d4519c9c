"""Instrumented communication: the one place that hands arrays to MPI (DESIGN contract 6).

``Comm`` wraps one mpi4py communicator (one grid axis). Every operation
- uses the uppercase buffer methods (``Send``, ``Irecv``, ``Allreduce``...), never pickle;
- records one trace event ``"<axis>.<op>"`` with its payload bytes and, for point-to-point, the
  peer's world rank (non-blocking operations record the post, then ``"<axis>.wait"``);
- checks that a received message has exactly the expected byte count, so a shape or dtype
  disagreement between sender and receiver is an error, not silent garbage.

GPU arrays (CuPy) go straight to MPI when the library is CUDA-aware (after synchronising the
current stream, since MPI knows nothing of CUDA streams), otherwise they are staged through
reused host buffers (pinned when CuPy is present). ``staging=True`` forces staging for NumPy
arrays too, which is how the staged code path is tested without a GPU.

A communicator of size 1 (and ``LocalComm``) communicates nothing and records nothing.
mpi4py is imported lazily, so ``LocalComm`` works without MPI.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time

import numpy as np

from mpipar.trace import Tracer

MPI = None  # mpi4py.MPI, loaded by _load_mpi() the first time a Comm is built

TAG_ACTIVATION = 0
TAG_GRADIENT = 1
MAX_CHUNKS = 16  # model chunks per rank a tag can tell apart
MAX_MB = 1000  # micro-batches per step a tag can tell apart
TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the standard allows

_OFF = Tracer(enabled=False)  # the tracer of an untraced Comm


def _load_mpi():
    global MPI
    if MPI is None:
        from mpi4py import MPI as _MPI

        MPI = _MPI
    return MPI


def make_tag(kind: int, mb: int, chunk: int) -> int:
    """A point-to-point tag from (kind, micro-batch, chunk); ``-1`` (not applicable) counts as 0.

    kind 0 = activation (forward), 1 = gradient (backward). Distinct keys give distinct tags,
    all below 32767, so messages in flight at once between two stages never match the wrong
    receive.
    """
    if kind not in (TAG_ACTIVATION, TAG_GRADIENT):
        raise ValueError(f"tag kind must be 0 (activation) or 1 (gradient), got {kind!r}")
    if not -1 <= mb < MAX_MB:
        raise ValueError(f"micro-batch {mb} out of range for tags: use fewer than {MAX_MB}")
    if not -1 <= chunk < MAX_CHUNKS:
        raise ValueError(f"chunk {chunk} out of range for tags: use fewer than {MAX_CHUNKS}")
    return (max(mb, 0) * MAX_CHUNKS + max(chunk, 0)) * 2 + kind


class MessageSizeError(ValueError):
    """A received message does not have the byte count the receiver expected."""


# --- CUDA awareness ----------------------------------------------------------------------------

_cuda_aware_cache: bool | None = None


def cuda_aware() -> bool:
    """Whether CuPy arrays may be handed to MPI directly.

    ``MPIPAR_CUDA_AWARE=0/1`` decides when set; otherwise ask the library: the MPI 4.1
    ``mpi_memory_alloc_kinds`` info key, then ``MPIX_Query_cuda_support`` (MPICH, Open MPI).
    """
    global _cuda_aware_cache
    env = os.environ.get("MPIPAR_CUDA_AWARE", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"MPIPAR_CUDA_AWARE must be 0 or 1, got {env!r}")
        return env == "1"
    if _cuda_aware_cache is None:
        _cuda_aware_cache = _detect_cuda_aware()
    return _cuda_aware_cache


def _detect_cuda_aware() -> bool:
    MPI = _load_mpi()
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds") or ""
        finally:
            info.Free()
        if "cuda" in kinds.lower():
            return True
    except Exception:  # pre-4.1 library or mpi4py: fall through
        pass
    for path in _loaded_mpi_libraries():
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = []
            return bool(fn())
    return False


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "libmpi" in line and "/" in line})
    except OSError:
        return []


# --- arrays and host staging -------------------------------------------------------------------


def _is_device(x) -> bool:
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def _xp_of(x):
    if _is_device(x):
        import cupy

        return cupy
    return np


def _sync_device() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


class HostBufferPool:
    """Reused host buffers for staging, bucketed by power-of-two capacity.

    Pinned (page-locked) when CuPy is loaded, so device copies run at full speed. A buffer is
    taken for the life of one operation (until ``wait`` for non-blocking ones) and given back.
    """

    MIN_BYTES = 4096

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}
        self.allocated = 0  # buffers ever allocated (tests check reuse)

    def acquire(self, nbytes: int) -> np.ndarray:
        cap = max(self.MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())
        bucket = self._free.get(cap)
        if bucket:
            return bucket.pop()
        self.allocated += 1
        if "cupy" in sys.modules:
            import cupy

            mem = cupy.cuda.alloc_pinned_memory(cap)
            return np.frombuffer(mem, dtype=np.uint8, count=cap)  # keeps `mem` alive
        return np.empty(cap, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        self._free.setdefault(buf.size, []).append(buf)


POOL = HostBufferPool()


def _host_view(buf: np.ndarray, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    return buf[:n].view(dtype).reshape(shape)


def _to_host(x, host: np.ndarray) -> None:
    if _is_device(x):
        x.get(out=host)
    else:
        np.copyto(host, x)


def _from_host(host: np.ndarray, out) -> None:
    if _is_device(out):
        out.set(host)
        _sync_device()  # the copy may be asynchronous from pinned memory: finish before reuse
    else:
        np.copyto(out, host)


# --- requests ----------------------------------------------------------------------------------


class Request:
    """A posted non-blocking operation; ``wait()`` returns the received / reduced array, or None."""

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
        comm = self._comm
        start = comm.tracer.now()
        status = MPI.Status()
        try:
            self._req.Wait(status)
        except MPI.Exception as exc:
            self._done = True
            raise comm._mpi_error(exc, "wait", *self._info) from exc
        self._complete(status, start)
        return self._result

    def test(self) -> bool:
        """True when done (and then ``wait()`` returns at once)."""
        if self._done:
            return True
        comm = self._comm
        status = MPI.Status()
        try:
            flag = self._req.Test(status)
        except MPI.Exception as exc:
            self._done = True
            raise comm._mpi_error(exc, "wait", *self._info) from exc
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
        comm.tracer.record(comm._k_wait, start, comm.tracer.now(), mb, chunk, nbytes, peer)


def wait_all(requests) -> list:
    """Wait for each request in order; returns their results."""
    return [r.wait() for r in requests]


# --- the communicator --------------------------------------------------------------------------

_OPS = ("sum", "mean", "max")


class Comm:
    """One traced communicator (a grid axis). See the module docstring for the rules."""

    def __init__(self, mpi_comm, axis, tracer=None, backend=None, world_ranks=None, staging=None):
        M = _load_mpi()
        self.mpi = mpi_comm
        self.axis = str(axis)
        self.tracer = tracer if tracer is not None else _OFF
        self.backend = backend
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
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
        self._k_wait = f"{self.axis}.wait"
        self._kinds = {}
        self._ops = {"sum": M.SUM, "mean": M.SUM, "max": M.MAX}

    # --- helpers ---------------------------------------------------------------------------

    def _kind(self, op: str) -> str:
        k = self._kinds.get(op)
        if k is None:
            k = self._kinds[op] = f"{self.axis}.{op}"
        return k

    def _stage(self, x) -> bool:
        if self.staging is not None:
            return bool(self.staging)
        return _is_device(x) and not cuda_aware()

    def _begin(self, x):
        """Let x's producing GPU work finish (MPI and our timer both need that); start the clock."""
        if _is_device(x):
            _sync_device()
        return self.tracer.now()

    def _rec(self, op, start, mb=-1, chunk=-1, nbytes=0, peer=-1):
        t = self.tracer
        if t.enabled:
            # Tracer.record without its argument conversions: this is the per-message hot path
            # and every value here is already an int / float
            end = time.perf_counter() - t.t0
            t._events.append(
                (self._kind(op), t.step, int(mb), int(chunk), start, end, int(nbytes), peer)
            )

    def _op(self, op):
        if op not in _OPS:
            raise ValueError(f"reduction op must be one of {_OPS}, got {op!r}")
        return self._ops[op]

    def _peer(self, r, what):
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.size:
            raise ValueError(
                f"{self.axis}: {what} rank {r!r} is outside 0..{self.size - 1} of this communicator"
            )
        return self.world_ranks[int(r)]

    @staticmethod
    def _check_tag(tag):
        if not 0 <= int(tag) < TAG_LIMIT:
            raise ValueError(f"tag {tag} must be in 0..{TAG_LIMIT - 1} (use make_tag)")

    @staticmethod
    def _contiguous(x, what):
        flags = x.flags
        if not flags["C_CONTIGUOUS"]:
            raise ValueError(f"{what} needs a C-contiguous array (use xp.ascontiguousarray)")

    def _mpi_error(self, exc, op, mb, chunk, nbytes, peer):
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return MessageSizeError(
                f"{self.axis}.{op} from world rank {peer} (mb {mb}, chunk {chunk}): the message is "
                f"larger than the expected {nbytes} bytes; sender and receiver disagree on the "
                f"shape or dtype"
            )
        return exc

    def _check_count(self, status, nbytes, shape, dtype, mb, chunk, peer, tag):
        got = status.Get_count(MPI.BYTE)
        if got != nbytes:
            raise MessageSizeError(
                f"{self.axis}.recv from world rank {peer} (tag {tag}, mb {mb}, chunk {chunk}): "
                f"expected {nbytes} bytes ({tuple(shape)} {np.dtype(dtype).name}) but the message "
                f"has {got} bytes; sender and receiver disagree on the shape or dtype"
            )

    def world_rank_of(self, local_rank) -> int:
        return self.world_ranks[local_rank]

    def free(self) -> None:
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi.Free()

    # --- point to point --------------------------------------------------------------------

    def _send_buffer(self, x):
        """(buffer handed to MPI, pool buffer to release or None)."""
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            host = _host_view(buf, x.shape, x.dtype)
            _to_host(x, host)
            return host, buf
        self._contiguous(x, f"{self.axis}.send")
        return x, None

    def send(self, x, dest, tag, *, mb=-1, chunk=-1) -> None:
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
        self._contiguous(out, f"{self.axis}.recv(out=...)")
        return out

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        """Receive into a new array, or into ``out`` (reuse avoids fresh-memory page faults)."""
        peer = self._peer(source, "source")
        self._check_tag(tag)
        out = self._recv_target(shape, dtype, xp, out)
        start = self._begin(out)  # the pool may reuse memory a queued kernel still writes
        stage = self._stage(out)
        buf = POOL.acquire(out.nbytes) if stage else None
        target = _host_view(buf, out.shape, out.dtype) if stage else out
        status = MPI.Status()
        try:
            try:
                self.mpi.Recv([target, MPI.BYTE], source, tag, status)
            except MPI.Exception as exc:
                raise self._mpi_error(exc, "recv", mb, chunk, out.nbytes, peer) from exc
            self._check_count(status, out.nbytes, shape, dtype, mb, chunk, peer, tag)
            if stage:
                _from_host(target, out)
        finally:
            if buf is not None:
                POOL.release(buf)
        self._rec("recv", start, mb, chunk, out.nbytes, peer)
        return out

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1) -> Request:
        """Post a send; x must stay alive and unchanged until ``wait`` (staging copies it now)."""
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
        peer = self._peer(source, "source")
        self._check_tag(tag)
        out = self._recv_target(shape, dtype, xp, out)
        start = self._begin(out)
        stage = self._stage(out)
        buf = POOL.acquire(out.nbytes) if stage else None
        target = _host_view(buf, out.shape, out.dtype) if stage else out
        req = self.mpi.Irecv([target, MPI.BYTE], source, tag)
        nbytes = out.nbytes

        def finish(status):
            try:
                self._check_count(status, nbytes, shape, dtype, mb, chunk, peer, tag)
                if stage:
                    _from_host(target, out)
            finally:
                if buf is not None:
                    POOL.release(buf)
            return out

        self._rec("recv", start, mb, chunk, nbytes, peer)
        return Request(self, req, finish, (mb, chunk, nbytes, peer), keep=target)

    # --- collectives -----------------------------------------------------------------------

    def allreduce(self, x, op="sum", inplace=False):
        """Elementwise reduction over the group; a new array, or x itself when ``inplace``."""
        mpi_op = self._op(op)
        if inplace:
            self._contiguous(x, f"{self.axis}.allreduce(inplace=True)")
        if self.size == 1:
            return x if inplace else x.copy()
        if op == "mean":
            _check_float(x, "mean")
        start = self._begin(x)
        xp = _xp_of(x)
        out = x if inplace else xp.empty(x.shape, dtype=x.dtype)
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            try:
                host = _host_view(buf, x.shape, x.dtype)
                _to_host(x, host)
                self.mpi.Allreduce(MPI.IN_PLACE, host, mpi_op)
                _from_host(host, out)
            finally:
                POOL.release(buf)
        elif inplace:
            self.mpi.Allreduce(MPI.IN_PLACE, x, mpi_op)
        else:
            self.mpi.Allreduce(xp.ascontiguousarray(x), out, mpi_op)
        if op == "mean":
            out /= self.size
        self._rec("allreduce", start, nbytes=x.nbytes)
        return out

    def iallreduce(self, x, op="sum") -> Request:
        """Post an in-place all-reduce of x; ``wait()`` returns x, reduced."""
        mpi_op = self._op(op)
        self._contiguous(x, f"{self.axis}.iallreduce")
        if self.size == 1:
            return Request(result=x)
        if op == "mean":
            _check_float(x, "mean")
        start = self._begin(x)
        stage = self._stage(x)
        buf = POOL.acquire(x.nbytes) if stage else None
        target = x
        if stage:
            target = _host_view(buf, x.shape, x.dtype)
            _to_host(x, target)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, target, mpi_op)
        size = self.size

        def finish(status):
            try:
                if stage:
                    _from_host(target, x)
            finally:
                if buf is not None:
                    POOL.release(buf)
            if op == "mean":
                x[...] /= size
            return x

        self._rec("allreduce", start, nbytes=x.nbytes)
        return Request(self, req, finish, (-1, -1, x.nbytes, -1), keep=target)

    def allgather(self, x, axis=0):
        """Concatenation of every rank's x (all the same shape) along ``axis``, in rank order."""
        axis = _norm_axis(axis, x.ndim)
        if self.size == 1:
            return x.copy()
        start = self._begin(x)
        xp = _xp_of(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        out = xp.empty((self.size * xm.shape[0],) + xm.shape[1:], dtype=x.dtype)
        if self._stage(x):
            bin_, bout = POOL.acquire(xm.nbytes), POOL.acquire(out.nbytes)
            try:
                hin = _host_view(bin_, xm.shape, xm.dtype)
                hout = _host_view(bout, out.shape, out.dtype)
                _to_host(xm, hin)
                self.mpi.Allgather(hin, hout)
                _from_host(hout, out)
            finally:
                POOL.release(bin_)
                POOL.release(bout)
        else:
            self.mpi.Allgather(xm, out)
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("allgather", start, nbytes=x.nbytes)
        return out

    def reduce_scatter(self, x, axis=0, op="sum"):
        """This rank's 1/size slice, along ``axis``, of the reduction of every rank's x."""
        mpi_op = self._op(op)
        axis = _norm_axis(axis, x.ndim)
        n = x.shape[axis]
        if n % self.size:
            raise ValueError(
                f"{self.axis}.reduce_scatter: dimension {axis} of shape {tuple(x.shape)} has "
                f"length {n}, not divisible by the {self.size} ranks of the {self.axis} group; "
                f"make it a multiple of {self.size}"
            )
        if self.size == 1:
            return x.copy()
        if op == "mean":
            _check_float(x, "mean")
        start = self._begin(x)
        xp = _xp_of(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        out = xp.empty((n // self.size,) + xm.shape[1:], dtype=x.dtype)
        if self._stage(x):
            bin_, bout = POOL.acquire(xm.nbytes), POOL.acquire(out.nbytes)
            try:
                hin = _host_view(bin_, xm.shape, xm.dtype)
                hout = _host_view(bout, out.shape, out.dtype)
                _to_host(xm, hin)
                self.mpi.Reduce_scatter_block(hin, hout, mpi_op)
                _from_host(hout, out)
            finally:
                POOL.release(bin_)
                POOL.release(bout)
        else:
            self.mpi.Reduce_scatter_block(xm, out, mpi_op)
        if op == "mean":
            out /= self.size
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("reduce_scatter", start, nbytes=x.nbytes)
        return out

    def broadcast(self, x, root=0):
        """Overwrite x on every rank with root's x (in place); returns x."""
        self._peer(root, "root")
        self._contiguous(x, f"{self.axis}.broadcast")
        if self.size == 1:
            return x
        start = self._begin(x)
        if self._stage(x):
            buf = POOL.acquire(x.nbytes)
            try:
                host = _host_view(buf, x.shape, x.dtype)
                if self.rank == root:
                    _to_host(x, host)
                self.mpi.Bcast([host, MPI.BYTE], root)
                if self.rank != root:
                    _from_host(host, x)
            finally:
                POOL.release(buf)
        else:
            self.mpi.Bcast([x, MPI.BYTE], root)
        self._rec("broadcast", start, nbytes=x.nbytes)
        return x

    def allreduce_scalar(self, value: float, op="sum") -> float:
        mpi_op = self._op(op)
        if self.size == 1:
            return float(value)
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
        if self.size == 1:
            return [data]
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
        if self.size == 1:
            return bytes(data)
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
        if self.size == 1:
            return
        start = self.tracer.now()
        self.mpi.Barrier()
        self._rec("barrier", start)


def _norm_axis(axis, ndim):
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def _check_float(x, op):
    if not np.issubdtype(np.dtype(x.dtype), np.inexact):
        raise TypeError(f"op={op!r} needs a floating-point array, got {x.dtype}")


class LocalComm:
    """The one-rank stand-in for ``Comm`` (no MPI at all): collectives return x or a copy.

    Records no events, since nothing is communicated; point-to-point raises (no peer exists).
    """

    size = 1
    rank = 0

    def __init__(self, axis="local", tracer=None, backend=None):
        self.axis = str(axis)
        self.tracer = tracer if tracer is not None else _OFF
        self.backend = backend
        self.world_ranks = [0]

    def world_rank_of(self, local_rank) -> int:
        if local_rank != 0:
            raise ValueError(f"{self.axis}: rank {local_rank} is outside 0..0 of a one-rank group")
        return 0

    def _no_peer(self, op):
        raise RuntimeError(
            f"{self.axis}.{op}: a one-rank communicator has no peer to talk to; "
            f"point-to-point needs a group of 2 or more ranks"
        )

    def send(self, x, dest, tag, *, mb=-1, chunk=-1):
        self._no_peer("send")

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        self._no_peer("recv")

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1):
        self._no_peer("isend")

    def irecv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None):
        self._no_peer("irecv")

    def allreduce(self, x, op="sum", inplace=False):
        if op not in _OPS:
            raise ValueError(f"reduction op must be one of {_OPS}, got {op!r}")
        return x if inplace else x.copy()

    def iallreduce(self, x, op="sum") -> Request:
        if op not in _OPS:
            raise ValueError(f"reduction op must be one of {_OPS}, got {op!r}")
        return Request(result=x)

    def allgather(self, x, axis=0):
        _norm_axis(axis, x.ndim)
        return x.copy()

    def reduce_scatter(self, x, axis=0, op="sum"):
        if op not in _OPS:
            raise ValueError(f"reduction op must be one of {_OPS}, got {op!r}")
        _norm_axis(axis, x.ndim)
        return x.copy()

    def broadcast(self, x, root=0):
        return x

    def allreduce_scalar(self, value: float, op="sum") -> float:
        return float(value)

    def gather_bytes(self, data: bytes, root=0, *, trace=True):
        return [bytes(data)]

    def broadcast_bytes(self, data, root=0, *, trace=True) -> bytes:
        return bytes(data)

    def barrier(self) -> None:
        pass

    def free(self) -> None:
        pass
