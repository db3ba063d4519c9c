"""What a model needs to know about 2D / 2.5D tensor parallelism on this rank (Optimus, arXiv
2104.05343; Tesseract, arXiv 2105.14500), and the factory that picks the context of
``parallel.tp_mode``.

The tp group of P = q^2 ranks is a q x q grid, tp rank t = (i, j) = (t // q, t % q). An
activation (batch, seq, hidden) is cut into q x q blocks: rank (i, j) holds the sequences of
batch block i and the hidden columns of block j. A weight (d_in, d_out) is cut the same way:
rank (i, j) holds rows block i, columns block j. ``row`` is the communicator of the ranks sharing
i (local rank j), ``col`` the one of the ranks sharing j (local rank i).

2.5D (Tesseract) stacks d such q x q layers: tp rank t = (k, i, j), k the depth. Each layer runs
2D on its own slab of the batch (sequences cut into d * q blocks: rank (k, i, j) holds block
k q + i), the weights are the same q x q blocks on every layer (replicated over depth by design,
1/q^2 per rank), and ``dep`` (the ranks sharing i and j) sums their gradients over the slabs.
2D is the case d = 1 (``dep`` a one-rank ``LocalComm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import tp_grid_shape
from ...mpi import LocalComm
from ...nn.params import ShardSpec
from ..tensor import TPContext
from ..tp_split import TPSplit
from .context3d import TP3DContext

# what the spec pairs name: the grid row index i and column index j (mapped to grid dims by mode)
ROW, COL = "row", "col"


@dataclass
class TP2DContext:
    comm: object  # the whole tp group (checkpoints gather over it)
    row: object  # ranks (i, *): local rank j
    col: object  # ranks (*, j): local rank i
    q: int
    dep: object = None  # ranks (*, i, j) in 2.5D: local rank k; a LocalComm in 2D
    mode: str = "2d"
    sequence_parallel: bool = False  # never: the 2D blocks already split every activation

    def __post_init__(self):
        if self.dep is None:
            self.dep = LocalComm("tp.dep")

    @property
    def d(self) -> int:
        return self.dep.size

    @property
    def size(self) -> int:
        return self.d * self.q * self.q

    @property
    def k(self) -> int:
        return self.dep.rank

    @property
    def split(self) -> TPSplit:
        shape = (self.q, self.q) if self.mode == "2d" else (self.d, self.q, self.q)
        return TPSplit(self.mode, shape)

    @property
    def batch_shards(self) -> int:
        return self.split.batch_shards

    @property
    def batch_block(self) -> int:
        """Which of the d * q blocks of a micro-batch's sequences this rank holds."""
        return self.k * self.q + self.i

    @property
    def i(self) -> int:
        return self.col.rank

    @property
    def j(self) -> int:
        return self.row.rank

    @property
    def rank(self) -> int:
        return (self.k * self.q + self.i) * self.q + self.j

    def spec(self, *pairs) -> ShardSpec:
        """A ShardSpec cutting tensor axes over grid dims: pairs (tensor axis, ROW or COL)."""
        dims = {ROW: 1, COL: 2} if self.mode == "2.5d" else {ROW: 0, COL: 1}
        grid = (self.d, self.q, self.q) if self.mode == "2.5d" else (self.q, self.q)
        return ShardSpec(split=tuple((ax, dims[g]) for ax, g in pairs), grid=grid)

    def sum_replicas(self, x):
        """Sum x over the ranks holding the same block of a column-cut vector (the column, and
        the depth in 2.5D): what each saw of its own sequences. In place; returns x."""
        x = self.col.allreduce(x, op="sum", inplace=True)
        return self.dep.allreduce(x, op="sum", inplace=True) if self.d > 1 else x


def tp_context(grid, parallel):
    """The tp context of ``parallel.tp_mode`` on this rank of ``grid`` (collective over tp for
    the 2D modes: they split the tp communicator into rows and columns)."""
    mode = parallel.tp_mode
    if mode == "1d" or grid.tp_size == 1:
        return TPContext.from_comm(grid.tp_comm, parallel.sequence_parallel)
    shape = tp_grid_shape(mode, grid.tp_size, parallel.tp_depth)
    if mode == "2d":
        col, row = grid.tp_subcomms(shape, ("tp.col", "tp.row"))
        if (col.rank, row.rank) != divmod(grid.tp_rank, shape[1]):
            raise RuntimeError(f"tp sub-communicators put tp rank {grid.tp_rank} at "
                               f"({col.rank}, {row.rank})")
        return TP2DContext(comm=grid.tp_comm, row=row, col=col, q=shape[0])
    if mode == "2.5d":
        dep, col, row = grid.tp_subcomms(shape, ("tp.dep", "tp.col", "tp.row"))
        ctx = TP2DContext(comm=grid.tp_comm, row=row, col=col, q=shape[1], dep=dep, mode=mode)
        if ctx.rank != grid.tp_rank:
            raise RuntimeError(f"tp sub-communicators put tp rank {grid.tp_rank} at {ctx.rank}")
        return ctx
    ci, cj, cl = grid.tp_subcomms(shape, ("tp.i", "tp.j", "tp.l"))
    ctx = TP3DContext(comm=grid.tp_comm, ci=ci, cj=cj, cl=cl, q=shape[0])
    if ctx.rank != grid.tp_rank:
        raise RuntimeError(f"tp sub-communicators put tp rank {grid.tp_rank} at {ctx.rank}")
    return ctx
