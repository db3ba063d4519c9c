"""What concerns the MPI job as a whole rather than one communicator.

- ``world``: the world as an entry point first sees it (size, rank, the library's name);
- ``failfast``: any failure on any rank ends every rank within seconds, said once (the exit
  codes ``EXIT_*``, ``guard``, ``install``, ``agree_on_start``, ``world_max``);
- ``watchdog``: ends the job when this rank makes no progress for ``run.watchdog_s``;
- ``dump``: every rank writes its own part of the HDF5 timing dump, world rank 0 the index.
"""

from mpipar.mpi.job import failfast
from mpipar.mpi.job.dump import dump_trace, prepare_dump
from mpipar.mpi.job.failfast import world_max
from mpipar.mpi.job.watchdog import Watchdog
from mpipar.mpi.job.world import library_version, world_size_and_rank

__all__ = ["Watchdog", "dump_trace", "failfast", "library_version", "prepare_dump", "world_max",
           "world_size_and_rank"]
