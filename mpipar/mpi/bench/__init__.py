"""``mpipar commbench``'s measurements: mpipar's ``Comm`` beside raw mpi4py.

- ``commbench``: the run (ping-pong between world ranks 0 and 1, then every collective kind),
  its preflight, and the result dict;
- ``collbench``: one collective kind timed raw and through ``Comm`` with each algorithm forced;
- ``report``: the printed tables, the HDF5 result and the tuned table ``--tune`` writes;
- ``sizes``: message sizes as the command line spells them (``4K``, ``64M``).

A layer above the communicator: nothing in ``mpipar.mpi`` outside this package imports it.
"""

from mpipar.mpi.bench.collbench import COLL_DTYPE, VARIANTS
from mpipar.mpi.bench.commbench import RESULT_DTYPE, preflight, run_benchmark
from mpipar.mpi.bench.report import format_tables, write_result, write_tuned
from mpipar.mpi.bench.sizes import DEFAULT_SIZES, format_size, parse_size, parse_sizes

__all__ = [
    "COLL_DTYPE", "DEFAULT_SIZES", "RESULT_DTYPE", "VARIANTS", "format_size", "format_tables",
    "parse_size", "parse_sizes", "preflight", "run_benchmark", "write_result", "write_tuned",
]
