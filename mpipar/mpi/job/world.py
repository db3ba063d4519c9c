"""The MPI world as an entry point first sees it (size, rank, library), before any grid."""

from __future__ import annotations


def world_size_and_rank() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


def library_version() -> str:
    """The MPI library's name and version, on one line (e.g. ``Open MPI v4.1.6, ...``)."""
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
