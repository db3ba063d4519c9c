"""A run that flushes its dump after step 0 and then dies on one rank mid step 1.

Run: mpiexec -n N python tests/mpi/trace_partial.py PATH
The job must abort (failfast); every rank's part must hold (at least) step 0, the failed
rank's exactly step 0, and the dump must read as incomplete.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpipar.mpi import ProcessGrid, dump_trace, failfast
from mpipar.trace import Tracer

failfast.install()
path = sys.argv[1]
tracer = Tracer(enabled=True)
n = MPI.COMM_WORLD.Get_size()
g = ProcessGrid(n, 1, 1, tracer=tracer)
for step in range(2):
    tracer.step = step
    with tracer.region("F", mb=0):
        g.dp_comm.allreduce(np.ones(8) * (g.rank + 1))
    if step == 1 and g.rank == n - 1:
        raise RuntimeError(f"deliberate failure in step 1 on rank {g.rank}")
    dump_trace(tracer, g, path, {"config": {"steps": 2}})
g.world_comm.barrier()  # the failed rank never gets here, so neither does any other
print("unreachable: the job survived a failed rank", flush=True)
