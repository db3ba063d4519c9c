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


TP_MODES = ("1d", "2d", "2.5d", "3d")


def _iroot(n: int, k: int) -> int | None:
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c ** k == n:
            return c
    return None


def tp_grid_shape(mode: str, tp: int, depth: int = 1) -> tuple[int, ...]:
    """The shape of the tensor-parallel group for ``parallel.tp_mode``: 1d (tp,), 2d (q, q) with
    tp = q^2, 2.5d (d, q, q) with tp = d q^2, 3d (q, q, q) with tp = q^3. Raises ``GridError``
    naming the value to change."""
    if mode not in TP_MODES:
        raise GridError(f"parallel.tp_mode = {mode!r}: use one of {', '.join(TP_MODES)}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise GridError(f"parallel.tp_depth = {depth!r} must be an integer >= 1")
    if depth != 1 and mode != "2.5d":
        raise GridError(f"parallel.tp_depth = {depth} only applies to tp_mode 2.5d (tp_mode is "
                        f"{mode}): drop --tp-depth or use --tp-mode 2.5d")
    if mode == "1d":
        return (tp,)
    if mode == "3d":
        q = _iroot(tp, 3)
        if q is None:
            raise GridError(f"tp_mode 3d needs tp = q^3 (1, 8, 27, 64, ...), got tp = {tp}: "
                            f"use a cube")
        return (q, q, q)
    if tp % depth:
        raise GridError(f"tp_mode 2.5d needs tp = tp_depth * q^2, but tp = {tp} does not "
                        f"divide by tp_depth = {depth}")
    q = _iroot(tp // depth, 2)
    if q is None:
        what = "tp" if mode == "2d" else f"tp / tp_depth = {tp} / {depth}"
        raise GridError(f"tp_mode {mode} needs {what} = q^2 (1, 4, 9, 16, ...), got "
                        f"{tp // depth}: use a square")
    return (q, q) if mode == "2d" else (depth, q, q)


def tp_batch_shards(mode: str, shape: tuple) -> int:
    """Over how many ranks a tp mode splits the sequences of a micro-batch (activations are
    (batch, seq, hidden) with the batch cut): 1d none, 2d q (grid rows), 2.5d d * q (depth and
    rows), 3d q * q."""
    if mode == "1d":
        return 1
    if mode == "2d":
        return shape[0]
    if mode == "2.5d":
        return shape[0] * shape[1]
    return shape[0] * shape[1]
