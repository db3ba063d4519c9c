"""The MPI layer: the only package that imports mpi4py. Other layers import from here.

- the communicator: ``Communicator`` (the interface, ``interface.py``), ``Comm`` (two or more
  ranks), ``LocalComm`` (one rank, no MPI), ``Request``, tags (``make_tag``, ``TAG_*``,
  ``MAX_MB``, ``MAX_CHUNKS``), ``MessageSizeError``;
- the grid: ``ProcessGrid`` (a communicator per axis), ``grid_layout``, ``axis_groups``,
  ``bind_gpu``;
- the collectives' progress: ``progress`` (advance the non-blocking ones), ``in_flight``,
  ``pending_collectives`` (the outstanding ones' list, truthy while any is: read, never changed);
- getting arrays to MPI: ``cuda_aware``, ``load_mpi``;
- the job as a whole (``job/``): ``failfast`` (a module: ``guard``, ``EXIT_*``...),
  ``world_max``, ``Watchdog``, ``dump_trace``, ``world_size_and_rank``, ``library_version``.

Importing this package loads no MPI: mpi4py is imported when the first communicator or grid is
built. Inside: ``comm.py`` (``Comm``: its small operations) with its mixins ``p2p.py``,
``collectives.py``, ``nonblocking.py``; ``windows.py`` (its duplicate communicator and shared
windows); ``requests.py``, ``local.py``, ``common.py`` (tags and argument checks);
``algorithms.py`` (ring, Rabenseifner), ``shm.py`` and ``shm_registered.py`` (one node's shared
memory), ``tuning.py`` (which algorithm); ``staging.py`` (device arrays, host buffers);
``grid.py``; ``job/``; and ``bench/`` (``mpipar commbench``: imported by the command, not here).
"""

from mpipar.mpi.algorithms import in_flight, pending_collectives, progress
from mpipar.mpi.comm import Comm
from mpipar.mpi.common import (
    MAX_CHUNKS,
    MAX_MB,
    TAG_ACTIVATION,
    TAG_GRADIENT,
    TAG_LIMIT,
    MessageSizeError,
    make_tag,
)
from mpipar.mpi.grid import ProcessGrid, axis_groups, bind_gpu, grid_layout
from mpipar.mpi.interface import Communicator, Pending
from mpipar.mpi.job import (
    Watchdog,
    dump_trace,
    failfast,
    library_version,
    prepare_dump,
    world_max,
    world_size_and_rank,
)
from mpipar.mpi.local import LocalComm
from mpipar.mpi.requests import Request
from mpipar.mpi.staging import cuda_aware, load_mpi

__all__ = [
    "MAX_CHUNKS", "MAX_MB", "TAG_ACTIVATION", "TAG_GRADIENT", "TAG_LIMIT", "Comm", "Communicator",
    "LocalComm", "MessageSizeError", "Pending", "ProcessGrid", "Request", "Watchdog",
    "axis_groups", "bind_gpu", "cuda_aware", "dump_trace", "failfast", "grid_layout", "in_flight",
    "library_version", "load_mpi", "make_tag", "pending_collectives", "prepare_dump", "progress",
    "world_max", "world_size_and_rank",
]
