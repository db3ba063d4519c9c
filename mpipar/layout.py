"""The pure rules of the dp x pp x tp grid, shared by the config (checked before any MPI) and by
``mpipar.mpi.grid`` (which lays the ranks out): axis sizes, the rank order, the world size.

One place for each rule, so a config that passes here is one the grid accepts, with the same
message. No MPI, no NumPy.
"""

from __future__ import annotations

AXES = ("dp", "pp", "tp")
DEFAULT_ORDER = "tp-dp-pp"


class GridError(ValueError):
    """A grid that cannot be laid out on the ranks mpiexec started."""


def check_axes(dp, pp, tp) -> None:
    """Each axis size is an integer >= 1."""
    for name, n in (("dp", dp), ("pp", pp), ("tp", tp)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GridError(f"--{name} must be an integer >= 1, got {n!r} (config: "
                            f"parallel.{name}); use 1 to leave that axis unsplit")


def check_grid(dp, pp, tp, world_size) -> None:
    """Raise ``GridError`` naming the number to change. No MPI: call it before any MPI work."""
    check_axes(dp, pp, tp)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GridError(f"world size must be an integer >= 1, got {world_size!r}")
    product = dp * pp * tp
    if product != world_size:
        raise GridError(
            f"dp*pp*tp = {dp}*{pp}*{tp} = {product} but mpiexec started {world_size} ranks: "
            f"change --dp/--pp/--tp so their product is {world_size}, "
            f"or run mpiexec -n {product}"
        )


def parse_order(order: str) -> tuple[str, str, str]:
    """``"tp-dp-pp"`` -> ("tp", "dp", "pp"), fastest-varying axis first; any permutation."""
    parts = tuple(p.strip() for p in str(order).split("-"))
    if sorted(parts) != sorted(AXES):
        raise GridError(
            f"rank order {order!r} (parallel.order) must name each of tp, dp, pp once: a "
            f"permutation, fastest-varying first (e.g. {DEFAULT_ORDER!r})"
        )
    return parts  # type: ignore[return-value]
