"""The array module (NumPy or CuPy) and the dtype, chosen in one place.

Every piece of math asks this module for ``xp`` instead of importing numpy, so the same code runs
on the CPU and on an NVIDIA GPU. The choice comes from ``--device`` and the
config's dtype (float32 for training, float64 for the exactness tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": np.float32, "float64": np.float64}


def cupy_available() -> tuple[bool, str]:
    """(True, "") when CuPy imports and sees a CUDA device, else (False, why not)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return False, f"cupy is not importable ({exc.__class__.__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"cupy sees no CUDA device ({exc})"
    if n < 1:
        return False, "cupy sees no CUDA device"
    return True, ""


@dataclass(frozen=True)
class Backend:
    """The array module and dtype a run computes with."""

    device: str = "cpu"
    dtype_name: str = "float32"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype_name!r}")
        if self.device == "cuda":
            ok, why = cupy_available()
            if not ok:
                raise RuntimeError(f"--device cuda asked for, but {why}; use --device cpu")

    @property
    def xp(self):
        if self.device == "cuda":
            import cupy

            return cupy
        return np

    @property
    def dtype(self):
        return DTYPES[self.dtype_name]

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"

    def asarray(self, a, dtype=None):
        """Move a host or device array onto this backend, in ``dtype`` (default: the run's)."""
        return self.xp.asarray(a, dtype=self.dtype if dtype is None else dtype)

    def synchronize(self) -> None:
        """Wait for queued GPU work (a no-op on the CPU); timers call this before reading clocks."""
        if self.is_gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()


def to_numpy(a) -> np.ndarray:
    """A host NumPy copy (or view) of a NumPy or CuPy array."""
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)
    if get is not None:
        return get()
    return np.asarray(a)


def array_module(a):
    """numpy or cupy, whichever owns ``a``."""
    if isinstance(a, np.ndarray) or np.isscalar(a):
        return np
    import cupy

    return cupy.get_array_module(a)
