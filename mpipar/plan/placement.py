"""Which link each parallel axis's traffic crosses: inside a node or between nodes.

A run of ``dp x pp x tp`` ranks on nodes of ``ranks_per_node`` ranks each places world rank r
on node ``r // ranks_per_node`` (``mpiexec -ppn``: nodes filled in turn), and ``parallel.order``
decides which world ranks form each axis's groups (``mpipar.mpi.grid.axis_groups``, the same
pure arithmetic ``ProcessGrid`` splits its communicators by). An axis whose groups hold ranks
of more than one node is priced on the spec's ``[inter_node]`` link: its collectives (tp's
all-reduces inside the units, dp's bucket all-reduce) and, for pp, the stage-to-stage sends. An
axis kept inside a node keeps the node's links: ``[collective]`` (else ``[intra_node]``) for
collectives, ``[intra_node]`` for sends. A group that spans nodes waits on its slowest hop, so
one spanning group prices the whole axis across (every group runs the same collectives at the
same time).
"""

from __future__ import annotations

from mpipar.layout import AXES, DEFAULT_ORDER, GridError
from mpipar.mpi.grid import axis_groups  # pure arithmetic: importing it loads no MPI

from .cluster import Cluster, Link
from .errors import PlanError


def spans_nodes(grid: dict, ranks_per_node: int | None, order: str | None = None) -> dict:
    """{axis: True where a group of that axis holds ranks of more than one node}.
    ``ranks_per_node`` None (or at least the world): one node, nothing spans; ``order``:
    default the grid's ``order``, else ``parallel.order``'s default."""
    dp, pp, tp = (int(grid.get(a, 1)) for a in AXES)
    world = dp * pp * tp
    if ranks_per_node is not None and ranks_per_node < 1:
        raise PlanError(f"ranks per node must be at least 1, got {ranks_per_node}")
    if ranks_per_node is None or ranks_per_node >= world:
        return dict.fromkeys(AXES, False)
    order = order or grid.get("order") or DEFAULT_ORDER
    try:
        return {a: any(len({r // ranks_per_node for r in g}) > 1
                       for g in axis_groups(dp, pp, tp, a, order))
                for a in AXES}
    except GridError as exc:
        raise PlanError(f"placement: {exc}") from None


def axis_links(c: Cluster, grid: dict, ranks_per_node: int | None,
               order: str | None = None) -> dict[str, Link]:
    """{"tp", "dp": the link its collectives cost on; "pp": the link its sends cost on;
    "world": the link of an all-reduce over every rank (the gradient norm)}."""
    span = spans_nodes(grid, ranks_per_node, order)
    coll = c.collective or c.intra
    out = {a: c.inter if span[a] else coll for a in ("tp", "dp")}
    out["pp"] = c.inter if span["pp"] else c.intra
    out["world"] = c.inter if any(span.values()) else coll
    return out
