"""Gather every rank's trace to world rank 0 and write the HDF5 timing dump (docs/dump_schema.md).

Collective: every rank calls ``dump_trace``. It may be called many times in a run, with
``file_attrs={"complete": True, ...}`` on the final call of a run that ended normally. The first
call of a run writes a new file atomically; each later one gathers and appends only the events
recorded since the previous call, which every rank then forgets (memory and flush cost stay
bounded however long the run). A crashed run keeps everything up to its last flush.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import struct
import subprocess
import sys

import numpy as np

from mpipar.mpi.job.world import library_version
from mpipar.trace import EVENT_DTYPE, append_dump, write_dump


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The git commit of the running mpipar (``unknown`` outside a checkout; ``+dirty``: edited)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0:
            return "unknown"
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10,
        )
        return commit + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    """Versions of what computed and communicated (CuPy only if this process loaded it)."""
    from mpi4py import MPI

    import mpipar

    def version_of(name):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except Exception:
                return "not installed"
        return str(getattr(mod, "__version__", "unknown"))

    import mpi4py

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": str(sys.modules["cupy"].__version__) if "cupy" in sys.modules else "not loaded",
        "mpi4py": mpi4py.__version__,
        "mpi_library": library_version(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "h5py": version_of("h5py"),
        "mpipar": mpipar.__version__,
    }


def _device_name(tracer) -> str:
    backend = getattr(tracer, "backend", None)
    if backend is not None and getattr(backend, "is_gpu", False):
        import cupy

        return f"cuda:{cupy.cuda.Device().id}"
    return "cpu"


def _pack(attrs: dict, events: np.ndarray) -> bytes:
    head = json.dumps(attrs).encode()
    return struct.pack("<q", len(head)) + head + events.tobytes()


def _unpack(blob: bytes):
    (n,) = struct.unpack_from("<q", blob)
    attrs = json.loads(blob[8 : 8 + n].decode())
    events = np.frombuffer(blob[8 + n :], dtype=EVENT_DTYPE).copy()
    return attrs, events


def dump_trace(
    tracer, grid_or_comm, path, file_attrs: dict, rank_attrs: dict | None = None
) -> None:
    """Gather all ranks' events (and rank 0's metrics) to world rank 0, which writes ``path``.

    ``grid_or_comm``: a ProcessGrid (coordinates and the grid attribute come from it) or a world
    Comm (a LocalComm in a one-rank run). ``file_attrs`` (e.g. ``config``, ``complete``) override
    the standard file attributes; ``rank_attrs`` add to this rank's ``/ranks/<r>`` attributes.
    The gather itself is not traced.
    """
    grid = grid_or_comm if hasattr(grid_or_comm, "world_comm") else None
    comm = grid.world_comm if grid is not None else grid_or_comm  # a Comm, or a LocalComm

    mine = {
        "dp": grid.dp_rank if grid is not None else -1,
        "pp": grid.pp_rank if grid is not None else -1,
        "tp": grid.tp_rank if grid is not None else -1,
        "hostname": socket.gethostname(),
        "device": _device_name(tracer),
    }
    mine.update(rank_attrs or {})
    # trace=False: the dump's own traffic is not an event
    events, metrics = tracer.take()  # only what is new since the last flush
    blobs = comm.gather_bytes(_pack(mine, events), root=0, trace=False)
    if comm.rank != 0:
        return

    per_rank = [_unpack(b) for b in blobs]
    attrs = [a for a, _ in per_rank]
    events = [e for _, e in per_rank]
    fa = {
        "config": {},
        "grid": grid.as_dict() if grid is not None else {"dp": 1, "pp": 1, "tp": 1, "order": ""},
        "world_size": comm.size,
        "hostnames": [a.get("hostname", "") for a in attrs],
        "devices": [a.get("device", "cpu") for a in attrs],
        "versions": versions(),
        "git_commit": git_commit(),
        "start_time": getattr(tracer, "start_time", ""),
        "complete": False,
    }
    fa.update(file_attrs or {})
    fa["complete"] = bool(fa["complete"])
    key = os.path.abspath(os.fspath(path))
    if key in tracer.dumped:
        append_dump(path, events, attrs, fa, metrics=metrics)
    else:
        write_dump(path, events, attrs, fa, metrics=metrics)
        tracer.dumped.add(key)
