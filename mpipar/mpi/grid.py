"""The dp x pp x tp process grid: which world rank has which coordinates; a communicator per axis.

Rank order (Megatron's ``parallel_state``): ``order`` lists the axes fastest-varying first. The
default ``"tp-dp-pp"`` puts the ranks of one tensor-parallel group next to each other (same node,
fastest links: tp talks inside every layer), then data parallelism, then pipeline stages, which
only exchange one activation per micro-batch. With dp=2, pp=2, tp=2 and the default order:

    world rank: 0 1 2 3 4 5 6 7
    tp rank:    0 1 0 1 0 1 0 1
    dp rank:    0 0 1 1 0 0 1 1
    pp rank:    0 0 0 0 1 1 1 1

The layout itself (``grid_layout``, ``axis_groups``, and the rules they share with the config in
``mpipar.layout``) is pure arithmetic so it can be tested for every grid without MPI;
``ProcessGrid`` then splits the world communicator accordingly.
"""

from __future__ import annotations

import socket

from mpipar.layout import (  # noqa: F401  (GridError, check_grid: this module's API too)
    AXES,
    DEFAULT_ORDER,
    GridError,
    check_axes,
    check_grid,
    parse_order,
)
from mpipar.mpi import tuning
from mpipar.mpi.comm import Comm
from mpipar.mpi.hierarchical import node_index, topology
from mpipar.mpi.interface import Communicator
from mpipar.mpi.job.watchdog import know_hosts
from mpipar.mpi.local import LocalComm
from mpipar.mpi.request_pool import grow_request_pool


def _strides(sizes: dict, order: str) -> dict:
    strides, s = {}, 1
    for axis in parse_order(order):
        strides[axis] = s
        s *= sizes[axis]
    return strides


def grid_layout(dp, pp, tp, order=DEFAULT_ORDER) -> list[tuple[int, int, int]]:
    """The coordinate table: entry r is world rank r's (dp_rank, pp_rank, tp_rank)."""
    check_axes(dp, pp, tp)
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    strides = _strides(sizes, order)
    return [
        tuple((r // strides[a]) % sizes[a] for a in AXES)  # type: ignore[misc]
        for r in range(dp * pp * tp)
    ]


def world_rank_of(dp_rank, pp_rank, tp_rank, dp, pp, tp, order=DEFAULT_ORDER) -> int:
    """Inverse of ``grid_layout``."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    coords = {"dp": dp_rank, "pp": pp_rank, "tp": tp_rank}
    for a in AXES:
        if not 0 <= coords[a] < sizes[a]:
            raise GridError(f"{a} rank {coords[a]} is outside 0..{sizes[a] - 1}")
    strides = _strides(sizes, order)
    return sum(coords[a] * strides[a] for a in AXES)


def axis_groups(dp, pp, tp, axis, order=DEFAULT_ORDER) -> list[list[int]]:
    """The communicators along ``axis``: each a list of world ranks, ordered by that axis' rank.

    Every rank belongs to exactly one group per axis; the group of a rank holds the ranks that
    share its other two coordinates. Groups are listed by their lowest world rank.
    """
    if axis not in AXES:
        raise GridError(f"axis must be one of {AXES}, got {axis!r}")
    layout = grid_layout(dp, pp, tp, order)
    k = AXES.index(axis)
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for r, c in enumerate(layout):
        key = tuple(c[i] for i in range(3) if i != k)
        groups.setdefault(key, []).append((c[k], r))
    return sorted(([r for _, r in sorted(g)] for g in groups.values()), key=lambda g: g[0])


def orders():
    """Every rank order, the default first."""
    import itertools

    rest = ["-".join(o) for o in itertools.permutations(AXES)]
    return [DEFAULT_ORDER] + [o for o in rest if o != DEFAULT_ORDER]


def groups_across_nodes(dp, pp, tp, axis, order, node_of) -> list[list[int]]:
    """The ``axis`` groups whose ranks sit on more than one node (``node_of[r]``: rank r's)."""
    return [g for g in axis_groups(dp, pp, tp, axis, order) if len({node_of[r] for r in g}) > 1]


def node_labels(node_of, hostnames) -> list[str]:
    """A name per node: its host name, or "node<k> (<host>)" where host names do not tell the
    nodes apart (one machine that MPI was told is several: ``mpiexec -hosts a,b -launcher
    fork``)."""
    k = max(node_of) + 1 if node_of else 0
    names = [sorted({hostnames[r] for r in range(len(node_of)) if node_of[r] == j})
             for j in range(k)]
    if all(len(n) == 1 for n in names) and len({n[0] for n in names}) == k:
        return [n[0] for n in names]
    return [f"node{j} ({','.join(n)})" for j, n in enumerate(names)]


def placement_warning(dp, pp, tp, order, node_of, hostnames, axis="tp") -> str | None:
    """One line when an ``axis`` group (tp: it talks inside every layer) spans nodes: the
    first such group, its hosts, and the ``parallel.order`` that would keep every group of the
    axis inside a node (or that none can). None when every group sits on one node."""
    spans = groups_across_nodes(dp, pp, tp, axis, order, node_of)
    if not spans:
        return None
    labels = node_labels(node_of, hostnames)
    g = spans[0]
    hosts = ", ".join(dict.fromkeys(labels[node_of[r]] for r in g))
    keep = next((o for o in orders()
                 if not groups_across_nodes(dp, pp, tp, axis, o, node_of)), None)
    fix = (f"parallel.order = \"{keep}\" keeps every {axis} group inside a node" if keep
           else f"no parallel.order keeps {axis} = {(dp, pp, tp)[AXES.index(axis)]} inside a "
                f"node (too few ranks per node): lower {axis}")
    more = f" ({len(spans)} of {len(axis_groups(dp, pp, tp, axis, order))} groups)"
    return (f"[mpipar] warning: {axis} group of world ranks {','.join(map(str, g))} spans "
            f"hosts {hosts}{more}: it talks across the slower link in every layer; {fix}")


class ProcessGrid:
    """This rank's place in the grid and its traced communicators, one per axis plus world_comm.

    Each is a ``Communicator`` (``interface.py``): a ``Comm``, or for an axis of size 1 (and the
    world of a one-rank run) a ``LocalComm``: no MPI communicator is made for it, and callers
    test ``comm.size > 1``, never ``None``.

    Collective: every rank of ``world`` must construct it with the same arguments.
    """

    def __init__(self, dp, pp, tp, *, order=DEFAULT_ORDER, world=None, tracer=None, backend=None):
        from mpi4py import MPI

        world = MPI.COMM_WORLD if world is None else world
        check_grid(dp, pp, tp, world.Get_size())
        if world.Get_size() > 1:  # the library's request block now, not at a step (request_pool)
            grow_request_pool(MPI)
        # the node of every world rank, as MPI sees them; a collectives table tuned on another
        # topology is then ignored by the communicators made below
        self.node_of = node_index(world)
        self.topology = topology(self.node_of)
        tuning.use_topology(self.topology, world.Get_rank())
        self.order = "-".join(parse_order(order))
        self.dp_size, self.pp_size, self.tp_size = dp, pp, tp
        self.world_size = world.Get_size()
        self.rank = world.Get_rank()
        layout = grid_layout(dp, pp, tp, self.order)
        self.dp_rank, self.pp_rank, self.tp_rank = layout[self.rank]

        # world_comm: a duplicate, so the library's messages never match a user's on COMM_WORLD
        self.world_comm: Communicator
        if self.world_size == 1:
            self.world_comm = LocalComm("world", tracer, backend, world_rank=self.rank)
        else:
            ranks = list(range(self.world_size))
            self.world_comm = Comm(world.Dup(), "world", tracer, backend, world_ranks=ranks)
        self._tracer, self._backend = tracer, backend  # for the tp sub-communicators
        self.dp_comm: Communicator = self._split(world, "dp", tracer, backend)
        self.pp_comm: Communicator = self._split(world, "pp", tracer, backend)
        self.tp_comm: Communicator = self._split(world, "tp", tracer, backend)

        # hostnames of every world rank, once, for describe() and the dump
        self.hostname = socket.gethostname()
        blobs = self.world_comm.gather_bytes(self.hostname.encode(), root=0, trace=False)
        names = "\0".join(b.decode() for b in blobs) if blobs is not None else ""
        self.hostnames = self.world_comm.broadcast_bytes(names.encode(), trace=False).decode()
        self.hostnames = self.hostnames.split("\0")
        know_hosts({c.axis: [self.hostnames[r] for r in c.world_ranks]  # for a stall's line
                    for c in (self.world_comm, self.dp_comm, self.pp_comm, self.tp_comm)})

    def _split(self, world, axis, tracer, backend):
        """The communicator along ``axis``: a LocalComm when the axis has one rank (no MPI call,
        and every rank agrees since the sizes are the same everywhere), else an MPI split."""
        k = AXES.index(axis)
        me = self.coords
        if (self.dp_size, self.pp_size, self.tp_size)[k] == 1:
            return LocalComm(axis, tracer, backend, world_rank=self.rank)
        groups = axis_groups(self.dp_size, self.pp_size, self.tp_size, axis, self.order)
        # color: index of this rank's group; key: its rank along the axis (so local rank = coord)
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        mpi_comm = world.Split(color, me[k])
        if mpi_comm.Get_rank() != me[k] or mpi_comm.Get_size() != len(groups[color]):
            raise RuntimeError(f"{axis} split gave rank {mpi_comm.Get_rank()}, expected {me[k]}")
        return Comm(mpi_comm, axis, tracer, backend, world_ranks=groups[color])

    def tp_subcomms(self, shape: tuple, names: tuple) -> list:
        """Sub-communicators of the tp group laid out as a ``shape`` grid (2D: (q, q), 2.5D:
        (d, q, q), 3D: (q, q, q)), tp rank = row-major index. Entry k is the communicator along
        grid dim k (the ranks sharing every other coordinate), ordered by coordinate k, traced
        under ``names[k]`` (name them "tp.<x>": the analysis counts "tp.*" events as tp
        communication). Collective over the tp group; built once per shape and kept."""
        import numpy as np

        key = (tuple(shape), tuple(names))
        cache = self.__dict__.setdefault("_tp_sub", {})
        if key in cache:
            return cache[key]
        if int(np.prod(shape)) != self.tp_size:
            raise GridError(f"tp grid {tuple(shape)} has {int(np.prod(shape))} ranks but tp = "
                            f"{self.tp_size}")
        me = np.unravel_index(self.tp_rank, shape)
        out = []
        for k, n in enumerate(shape):
            if n == 1:
                out.append(LocalComm(names[k], self._tracer, self._backend, world_rank=self.rank))
                continue
            # colour: the coordinates other than k; key: coordinate k (local rank = coordinate)
            others = tuple(int(c) for i, c in enumerate(me) if i != k)
            color = int(np.ravel_multi_index(others, tuple(s for i, s in enumerate(shape)
                                                           if i != k))) if others else 0
            mpi_comm = self.tp_comm.mpi.Split(color, int(me[k]))
            members = []
            for c in range(n):
                idx = list(me)
                idx[k] = c
                members.append(self.tp_comm.world_ranks[int(np.ravel_multi_index(idx, shape))])
            out.append(Comm(mpi_comm, names[k], self._tracer, self._backend,
                            world_ranks=members))
        cache[key] = out
        return out

    @property
    def coords(self) -> tuple[int, int, int]:
        return (self.dp_rank, self.pp_rank, self.tp_rank)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def world_rank_of(self, dp, pp, tp) -> int:
        return world_rank_of(dp, pp, tp, self.dp_size, self.pp_size, self.tp_size, self.order)

    def as_dict(self) -> dict:
        """What the dump stores as its ``grid`` attribute."""
        return {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size, "order": self.order}

    def describe(self) -> str:
        """A table of every world rank's coordinates and host (no communication)."""
        layout = grid_layout(self.dp_size, self.pp_size, self.tp_size, self.order)
        lines = [
            f"grid dp={self.dp_size} pp={self.pp_size} tp={self.tp_size} order={self.order}",
            f"{'rank':>5} {'dp':>3} {'pp':>3} {'tp':>3}  host",
        ]
        hosts = (node_labels(self.node_of, self.hostnames) if self.topology["nodes"] > 1
                 else None)
        for r, (d, p, t) in enumerate(layout):
            host = hosts[self.node_of[r]] if hosts else self.hostnames[r]
            lines.append(f"{r:>5} {d:>3} {p:>3} {t:>3}  {host}")
        return "\n".join(lines)

    def placement(self) -> list[str]:
        """What a run prints about where its ranks are: nothing on one node; else the grid with
        hosts, and a warning when a tensor-parallel group spans nodes."""
        if self.topology["nodes"] < 2:
            return []
        warn = placement_warning(self.dp_size, self.pp_size, self.tp_size, self.order,
                                 self.node_of, self.hostnames)
        return [self.describe()] + ([warn] if warn else [])

    def free(self) -> None:
        """Release the communicators (optional; MPI_Finalize frees them too)."""
        for subs in self.__dict__.get("_tp_sub", {}).values():
            for c in subs:
                c.free()
        for c in (self.tp_comm, self.pp_comm, self.dp_comm, self.world_comm):
            c.free()


def bind_gpu(world=None) -> int:
    """Give each rank of a node its own GPU: node-local rank modulo the device count.

    Returns the device id made current for CuPy. Ranks outnumbering GPUs share them round-robin.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD if world is None else world
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        local_rank = node.Get_rank()
    finally:
        node.Free()
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if n < 1:
        raise RuntimeError("bind_gpu: CuPy sees no CUDA device; run with --device cpu")
    device = local_rank % n
    cupy.cuda.Device(device).use()
    return device
