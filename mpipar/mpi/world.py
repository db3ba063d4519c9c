"""The MPI world as the training entry point first sees it (size and rank), before any grid."""

from __future__ import annotations


def world_size_and_rank() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
