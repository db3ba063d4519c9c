"""Write the HDF5 timing dump: each rank its own part, world rank 0 the index that ties them
(docs/dump_schema.md, ``mpipar.trace_parts``).

Every rank calls ``dump_trace``, many times in a run, with ``file_attrs={"complete": True,
...}`` on the final call of a run that ended normally. Only the first call of a process talks
(one broadcast from rank 0: the run id, and whether a resumed run continues its dump); every
later one writes this rank's new events to its own part and returns, waiting for no other rank.
The events written are forgotten (memory and flush cost stay bounded however long the run); a
rank that dies loses nothing before its last flush. Each flush is recorded as a ``dump.flush``
event (step -1), handed out with the next flush.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
import sys
import uuid

import numpy as np

from mpipar import trace_parts as parts
from mpipar.mpi.job.world import library_version


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
    """Versions of what computed and communicated (CuPy only if this process loaded it): a
    copy of what the first call found (``prepare_dump``)."""
    return dict(_versions())


def prepare_dump() -> None:
    """Find what every flush writes into the index (``versions``, ``git_commit``: both cached)
    now, at a run's set-up: the first flush would otherwise spend 25-30 ms on them in the
    middle of the steps."""
    versions(), git_commit()


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
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


def dump_trace(
    tracer, grid_or_comm, path, file_attrs: dict, rank_attrs: dict | None = None
) -> None:
    """Write this rank's events since the last call to its part of the dump at ``path`` (rank
    0: its metrics too, and the index).

    ``grid_or_comm``: a ProcessGrid (coordinates and the grid attribute come from it) or a world
    Comm (a LocalComm in a one-rank run). ``file_attrs`` (e.g. ``config``, ``complete``) override
    the standard index attributes; ``rank_attrs`` add to this rank's part attributes. The first
    call's broadcast is not traced.
    """
    grid = grid_or_comm if hasattr(grid_or_comm, "world_comm") else None
    comm = grid.world_comm if grid is not None else grid_or_comm  # a Comm, or a LocalComm
    start = tracer.now()
    mine = {
        "dp": grid.dp_rank if grid is not None else -1,
        "pp": grid.pp_rank if grid is not None else -1,
        "tp": grid.tp_rank if grid is not None else -1,
        "hostname": socket.gethostname(),
        "device": _device_name(tracer),
    }
    mine.update(rank_attrs or {})
    events, metrics = tracer.take()  # only what is new since the last flush
    if comm.rank != 0:
        metrics = metrics[:0]  # every rank records them; rank 0's are the run's
    fa = {
        "config": {},
        "grid": grid.as_dict() if grid is not None else {"dp": 1, "pp": 1, "tp": 1, "order": ""},
        "versions": versions(),
        "git_commit": git_commit(),
        "start_time": getattr(tracer, "start_time", ""),
        "complete": False,
    }
    fa.update(file_attrs or {})
    complete = bool(fa["complete"])
    fa["complete"] = complete
    key = os.path.abspath(os.fspath(path))
    runs = tracer.dump_runs
    if key not in runs:
        runs[key], resumed = _agree(tracer, comm, key)
        if comm.rank == 0 and not resumed:
            parts.write_index(path, {k: v for k, v in fa.items() if k != "complete"}, comm.size,
                              runs[key])
        if resumed and os.path.isfile(parts.part_path(path, comm.rank)):
            parts.append_part(path, comm.rank, events, mine, metrics, complete)
        else:
            parts.write_part(path, comm.rank, runs[key], events, mine, metrics, complete)
    else:
        parts.append_part(path, comm.rank, events, mine, metrics, complete)
    if comm.rank == 0:  # after its own rows: the index's `complete` never runs ahead of them
        parts.update_index(path, fa)
    tracer.dumped.add(key)
    sink = tracer.sink()
    if sink is not None:
        sink(("dump.flush", -1, -1, -1, start, tracer.now(), int(events.nbytes), -1))


def _agree(tracer, comm, key) -> tuple[str, bool]:
    """(run id, whether this run continues the dump at ``key``), rank 0's word to every rank.
    A resumed run continues it when ``trace.rewind_dump`` said so (``tracer.dumped`` holds the
    path on rank 0) and the file is an index with a run id; otherwise a new run id."""
    msg = None
    if comm.rank == 0:
        old = parts.index_run_id(key) if key in tracer.dumped else None
        msg = json.dumps({"run_id": old or uuid.uuid4().hex, "resumed": old is not None}).encode()
    got = json.loads(comm.broadcast_bytes(msg, root=0, trace=False).decode())
    return got["run_id"], bool(got["resumed"])
