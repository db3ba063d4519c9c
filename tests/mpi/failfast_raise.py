"""One rank fails while the others block; the job must end at once with that rank's traceback.

Run: mpiexec -n N python tests/mpi/failfast_raise.py MODE
MODE: "hook" (uncaught exception, failfast.install), "guard" (inside failfast.guard()),
"exit" (sys.exit(3) inside guard()), "start" (the last rank alone fails its start:
failfast.agree_on_start must return 2 on every rank, the message printed once). The failing
rank is the last one; the other ranks wait in a receive (rank 0) or a barrier that can never
complete.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from mpipar.mpi import Comm, failfast

mode = sys.argv[1]
world = Comm(MPI.COMM_WORLD, "world")
bad = world.size - 1


def work():
    if world.rank == bad:
        time.sleep(0.2)
        if mode == "exit":
            sys.exit(3)
        raise RuntimeError(f"deliberate failure on rank {world.rank}")
    if world.rank == 0:
        world.recv((4,), np.float64, bad, 0)  # never sent
    world.barrier()


if mode == "start":
    failfast.install((ValueError,))
    error = ValueError("config file c.toml not found") if world.rank == bad else None
    code = failfast.agree_on_start(error, prefix="mpipar train: error: ")
    print(f"rank {world.rank} start code {code}", flush=True)
    sys.exit(code)
if mode == "hook":
    failfast.install()
    work()
else:
    with failfast.guard():
        work()
print("unreachable: a blocked rank got past the failure", flush=True)
