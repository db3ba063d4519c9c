"""Each rank's share of the node's cores, set before NumPy is imported.

Eight ranks on two cores, each with thread pools as large as the machine, spend their time
fighting over the cores. Unless the user set the variables, each rank gets
max(1, cores // ranks on this node) threads: the BLAS variables are set to that share, and
mpipar's kernels (``mpipar.nn.cpu``) read it from them and run on that many threads of their own,
holding BLAS at one thread per kernel thread (MPIPAR_KERNEL_THREADS overrides the count).
The launchers tell us the node-local rank count: MPICH/Hydra (MPI_LOCALNRANKS), Open MPI
(OMPI_COMM_WORLD_LOCAL_SIZE), Slurm (SLURM_NTASKS_PER_NODE or SLURM_CPUS_PER_TASK, which already
is the per-task share).
"""

from __future__ import annotations

import os

VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def local_ranks() -> int:
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "").split("(")[0].split(",")[0]
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


def set_blas_threads() -> int | None:
    """Set the BLAS thread variables that the user left unset; returns the count chosen."""
    if all(v in os.environ for v in VARS):
        return None
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit():
        n = int(per_task)
    else:
        n = max(1, (os.cpu_count() or 1) // local_ranks())
    for v in VARS:
        os.environ.setdefault(v, str(n))
    return n


def kernel_threads_setting() -> int | None:
    """MPIPAR_KERNEL_THREADS as a count, None when unset; a clear error when it is not one."""
    v = os.environ.get("MPIPAR_KERNEL_THREADS", "").strip()
    if not v:
        return None
    if not (v.isdigit() and int(v) > 0):
        raise ValueError(f"MPIPAR_KERNEL_THREADS={v!r}: give a whole number of threads >= 1 "
                         "(or unset it to use this rank's share of the cores)")
    return int(v)
