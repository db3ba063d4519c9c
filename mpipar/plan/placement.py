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

A node's link is shared by its ranks whose traffic crosses at once: a spec whose nodes have
fewer links than ranks (``[inter_node] nics_per_node``; the emulated cluster and a CPU cluster
have one, a DGX one per GPU) gives each of k crossing ranks bandwidth x nics / k. The ranks of
a node that cross for an axis: those in a spanning group of it (tp, dp, every rank for the
world's all-reduce), for pp those whose next or previous stage sits on another node; at most
as many as the node has cores (``cores_per_node``), since a rank off its core posts nothing
(on the emulated cluster, two ranks a node on one core: the link halved for both planned tp
across the nodes at 1.5x the measured step; experiments/README.md, section 9).
"""

from __future__ import annotations

import dataclasses

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


def crossing(grid: dict, ranks_per_node: int | None, order: str | None = None) -> dict:
    """{axis or "world": the most ranks of one node whose traffic of that axis leaves the node
    at the same time} (module doc); 0 where none does."""
    dp, pp, tp = (int(grid.get(a, 1)) for a in AXES)
    world = dp * pp * tp
    if not any(spans_nodes(grid, ranks_per_node, order).values()):  # checks the placement too
        return dict.fromkeys((*AXES, "world"), 0)
    order = order or grid.get("order") or DEFAULT_ORDER
    node = [r // ranks_per_node for r in range(world)]
    out = {}
    for a in AXES:
        leaving = set()
        for g in axis_groups(dp, pp, tp, a, order):
            if a == "pp":  # a stage's sends go to its neighbours only
                for x, y in zip(g, g[1:]):
                    if node[x] != node[y]:
                        leaving |= {x, y}
            elif len({node[r] for r in g}) > 1:
                leaving |= set(g)
        out[a] = max([sum(1 for r in leaving if node[r] == n) for n in set(node)] or [0])
    out["world"] = min(ranks_per_node, world)
    return out


def shared(link: Link, nics: int, ranks: int) -> Link:
    """``link`` as each of ``ranks`` ranks crossing at once sees it through ``nics`` links
    (0: one per rank)."""
    if not nics or ranks <= nics:
        return link
    return dataclasses.replace(link, bandwidth=link.bandwidth * nics / ranks)


def axis_links(c: Cluster, grid: dict, ranks_per_node: int | None,
               order: str | None = None) -> dict[str, Link]:
    """{"tp", "dp": the link its collectives cost on; "pp": the link its sends cost on;
    "world": the link of an all-reduce over every rank (the gradient norm)}; an axis across
    nodes on ``[inter_node]``, shared by the node's ranks crossing at once (module doc)."""
    span = spans_nodes(grid, ranks_per_node, order)
    many = crossing(grid, ranks_per_node, order)

    def across(a):
        at_once = many[a] if c.cores_per_node <= 0 else min(many[a], max(1, c.cores_per_node))
        return shared(c.inter, c.nics_per_node, int(at_once))

    coll = c.collective or c.intra
    out = {a: across(a) if span[a] else coll for a in ("tp", "dp")}
    out["pp"] = across("pp") if span["pp"] else c.intra
    out["world"] = across("world") if any(span.values()) else coll
    return out
