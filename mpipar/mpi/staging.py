"""Getting arrays to MPI: lazy mpi4py, CUDA-awareness detection, device sync, host staging.

GPU arrays (CuPy) go straight to MPI when the library is CUDA-aware (after synchronising the
current stream, since MPI knows nothing of CUDA streams), otherwise they are staged through
reused host buffers (pinned when CuPy is present). ``Comm`` (``mpipar.mpi.comm``) decides per
operation; the helpers here do the moving.

mpi4py is imported only by ``load_mpi()``, so importing this module (and ``LocalComm``) needs
no MPI.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import numpy as np

_MPI = None  # mpi4py.MPI once load_mpi() has run


def load_mpi():
    """mpi4py.MPI, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


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
    MPI = load_mpi()
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


# --- arrays ------------------------------------------------------------------------------------


def is_device(x) -> bool:
    """True for a GPU (CuPy) array."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def xp_of(x):
    """numpy or cupy, whichever owns x."""
    if is_device(x):
        import cupy

        return cupy
    return np


def sync_device() -> None:
    """Wait for the current CUDA stream (MPI and host timers know nothing of streams)."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


# --- host staging ------------------------------------------------------------------------------


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


def host_view(buf: np.ndarray, shape, dtype) -> np.ndarray:
    """The first bytes of a pool buffer seen as an array of ``shape`` and ``dtype``."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    return buf[:n].view(dtype).reshape(shape)


def to_host(x, host: np.ndarray) -> None:
    """Copy x (NumPy or CuPy) into the host array ``host``."""
    if is_device(x):
        x.get(out=host)
    else:
        np.copyto(host, x)


def from_host(host: np.ndarray, out) -> None:
    """Copy ``host`` into out (NumPy or CuPy); finished when this returns."""
    if is_device(out):
        out.set(host)
        sync_device()  # the copy may be asynchronous from pinned memory: finish before reuse
    else:
        np.copyto(out, host)


def copy_into(src, dst) -> None:
    """dst[...] = src between any mix of host and device arrays (finished on return)."""
    if is_device(dst) and not is_device(src):
        from_host(src, dst)
    elif is_device(src) and not is_device(dst):
        to_host(src, dst)
    else:
        dst[...] = src
