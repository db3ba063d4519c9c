"""What a model needs to know about 2D tensor parallelism on this rank (Optimus, arXiv
2104.05343), and the factory that picks the context of ``parallel.tp_mode``.

The tp group of P = q^2 ranks is a q x q grid, tp rank t = (i, j) = (t // q, t % q). An
activation (batch, seq, hidden) is cut into q x q blocks: rank (i, j) holds the sequences of
batch block i and the hidden columns of block j. A weight (d_in, d_out) is cut the same way:
rank (i, j) holds rows block i, columns block j. ``row`` is the communicator of the ranks sharing
i (local rank j), ``col`` the one of the ranks sharing j (local rank i).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import tp_grid_shape
from ...nn.params import ShardSpec
from ..tensor import TPContext

# grid dims of the 2D layout: the spec pairs name them
ROW, COL = 0, 1


@dataclass
class TP2DContext:
    comm: object  # the whole tp group (checkpoints gather over it)
    row: object  # ranks (i, *): local rank j
    col: object  # ranks (*, j): local rank i
    q: int
    mode: str = "2d"
    sequence_parallel: bool = False  # never: the 2D blocks already split every activation

    @property
    def size(self) -> int:
        return self.q * self.q

    @property
    def i(self) -> int:
        return self.col.rank

    @property
    def j(self) -> int:
        return self.row.rank

    @property
    def rank(self) -> int:
        return self.i * self.q + self.j

    def spec(self, *pairs) -> ShardSpec:
        """A ShardSpec cutting tensor axes over grid dims: pairs (tensor axis, ROW or COL)."""
        return ShardSpec(split=tuple(pairs), grid=(self.q, self.q))

    def divide(self, n: int, what: str) -> int:
        if n % self.q:
            raise ValueError(f"{what} = {n} is not divisible by q = {self.q} (tp_mode 2d, tp = "
                             f"{self.size} = q^2): choose sizes divisible by q")
        return n // self.q


def tp_context(grid, parallel):
    """The tp context of ``parallel.tp_mode`` on this rank of ``grid`` (collective over tp for
    the 2D modes: they split the tp communicator into rows and columns)."""
    mode = getattr(parallel, "tp_mode", "1d")
    if mode == "1d" or grid.tp_size == 1:
        return TPContext.from_comm(grid.tp_comm, parallel.sequence_parallel)
    shape = tp_grid_shape(mode, grid.tp_size, getattr(parallel, "tp_depth", 1))
    if mode == "2d":
        col, row = grid.tp_subcomms(shape, ("tp_col", "tp_row"))
        if (col.rank, row.rank) != divmod(grid.tp_rank, shape[1]):
            raise RuntimeError(f"tp sub-communicators put tp rank {grid.tp_rank} at "
                               f"({col.rank}, {row.rank})")
        return TP2DContext(comm=grid.tp_comm, row=row, col=col, q=shape[0])
    raise ValueError(f"parallel.tp_mode = {mode!r} is not built yet: use 1d or 2d")
