"""What a model needs to know about 3D tensor parallelism on this rank (arXiv 2105.14450).

The tp group of P = q^3 ranks is a q x q x q cube, tp rank t = (i, j, l) row-major. A linear's
product follows the 3D matrix multiplication (Agarwal et al. 1995): input block (tokens i,
hidden a) times weight block (hidden a, out b), summed over a. Nothing is replicated: each block
is cut once more, over the third dim, and gathered just in time. Activations alternate between
two layouts ("parities"): parity 0 holds tokens block i, piece j of it, hidden block l; a linear
turns it into parity 1 (tokens block i, piece l, hidden block j) and the next one back, so every
transformer block starts and ends in parity 0. Per rank: 1/q^3 of every activation and matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...nn.params import ShardSpec
from ..tp_split import TPSplit

DIMS = {"i": 0, "j": 1, "l": 2}
# (hidden dim, token-piece dim) of each parity
PARITY = {0: ("l", "j"), 1: ("j", "l")}


@dataclass
class TP3DContext:
    comm: object  # the whole tp group
    ci: object  # ranks (*, j, l): local rank i
    cj: object  # ranks (i, *, l): local rank j
    cl: object  # ranks (i, j, *): local rank l
    q: int
    mode: str = "3d"
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return self.q ** 3

    def coord(self, name: str) -> int:
        return self.along(name).rank

    def along(self, name: str):
        """The communicator along grid dim ``name`` ("i", "j" or "l")."""
        return {"i": self.ci, "j": self.cj, "l": self.cl}[name]

    @property
    def rank(self) -> int:
        return (self.ci.rank * self.q + self.cj.rank) * self.q + self.cl.rank

    @property
    def split(self) -> TPSplit:
        return TPSplit("3d", (self.q, self.q, self.q))

    @property
    def batch_shards(self) -> int:
        return self.split.batch_shards

    def batch_block(self, parity: int) -> int:
        """Which of the q^2 blocks of a micro-batch's sequences this rank holds in a parity."""
        return self.ci.rank * self.q + self.coord(PARITY[parity][1])

    def spec(self, *pairs) -> ShardSpec:
        """Pairs (tensor axis, "i" / "j" / "l"); pairs on one axis nest in the order given."""
        return ShardSpec(split=tuple((ax, DIMS[g]) for ax, g in pairs),
                         grid=(self.q, self.q, self.q))

    def sum_over(self, x, *names):
        """x summed in place over the communicators along ``names``."""
        for n in names:
            x = self.along(n).allreduce(x, op="sum", inplace=True)
        return x
