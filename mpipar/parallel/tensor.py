"""Tensor parallelism (Megatron 1D) by composition.

Megatron-LM (Shoeybi et al., 2019) splits a transformer layer with one conjugate pair of
communication operators per block:

- ``f`` (:class:`CopyToTP`): identity forward, all-reduce of the gradient backward;
- ``g`` (:class:`ReduceFromTP`): all-reduce forward, identity backward.

A column-parallel linear (weight split by output columns) follows ``f``; a row-parallel linear
(weight split by input rows) is followed by ``g`` and then its bias, added once. With sequence
parallelism (Korthikanti et al., 2022) the regions between blocks hold a slice of the sequence:
``f`` becomes an all-gather along the sequence (:class:`GatherSeq`, reduce-scatter backward) and
``g`` a reduce-scatter (:class:`ReduceScatterSeq`, all-gather backward); the bytes moved are the
same as the all-reduces they replace, and LayerNorm work and activations are split by tp.

These layers hold no MPI: they call a communicator object (``mpipar.mpi.comm.Comm``, or a
``LocalComm`` when tp = 1) given to them. With tp = 1 they are identities and never touch it, so
the one-rank model is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..mpi import LocalComm
from ..nn.layers import (
    Bias,
    CausalSelfAttention,
    Embedding,
    Layer,
    LayerNorm,
    Linear,
    PositionEmbedding,
    Sequential,
    TiedHead,
)
from ..nn.losses import CrossEntropyLoss
from ..nn.params import ShardSpec
from .tp_split import TPSplit

SEQ_AXIS = 1  # activations are (batch, sequence, hidden)


@dataclass
class TPContext:
    """What a model needs to know about tensor parallelism on this rank."""

    # the communicator along the tp axis: a Comm, or a LocalComm when tp is 1 (never None)
    comm: object = field(default_factory=lambda: LocalComm("tp"))
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    mode = "1d"  # parallel.tp_mode this context runs (a class constant: not a field)

    @classmethod
    def from_comm(cls, comm, sequence_parallel=False):
        return cls(comm=comm, size=comm.size, rank=comm.rank,
                   sequence_parallel=sequence_parallel and comm.size > 1)

    @property
    def col(self) -> ShardSpec:
        """Spec of a column-parallel (d_in, d_out) weight: split the output columns."""
        return ShardSpec(axis=1)

    @property
    def row(self) -> ShardSpec:
        """Spec of a row-parallel (d_in, d_out) weight: split the input rows."""
        return ShardSpec(axis=0)

    def enter(self, name="f") -> Layer:
        """The operator in front of a column-parallel region: f, or all-gather with SP."""
        return GatherSeq(self, name) if self.sequence_parallel else CopyToTP(self, name)

    def leave(self, name="g") -> Layer:
        """The operator after a row-parallel region: g, or reduce-scatter with SP."""
        return ReduceScatterSeq(self, name) if self.sequence_parallel else ReduceFromTP(self, name)

    @property
    def split(self) -> TPSplit:
        return TPSplit.of("1d", self.size, sequence_parallel=self.sequence_parallel)


class _TPOp(Layer):
    def __init__(self, tp: TPContext, name):
        super().__init__(name)
        self.tp = tp

    @property
    def active(self) -> bool:
        return self.tp.size > 1


class CopyToTP(_TPOp):
    """Megatron's f: identity forward, all-reduce (sum) of the input gradient backward."""

    def forward(self, x, mb=0):
        return x

    def backward_input(self, dy, mb=0):
        # dy is the fresh result of the column-parallel linear's input GEMM: reduce in place
        return self.tp.comm.allreduce(dy, op="sum", inplace=True) if self.active else dy


class ReduceFromTP(_TPOp):
    """Megatron's g: all-reduce (sum) forward of the row-parallel partial outputs, identity back."""

    def forward(self, x, mb=0):
        return self.tp.comm.allreduce(x, op="sum", inplace=True) if self.active else x

    def backward_input(self, dy, mb=0):
        return dy


class GatherSeq(_TPOp):
    """Sequence parallel f: all-gather the sequence shards forward, reduce-scatter backward."""

    def forward(self, x, mb=0):
        return self.tp.comm.allgather(x, axis=SEQ_AXIS) if self.active else x

    def backward_input(self, dy, mb=0):
        return self.tp.comm.reduce_scatter(dy, axis=SEQ_AXIS) if self.active else dy


class ReduceScatterSeq(_TPOp):
    """Sequence parallel g: reduce-scatter along the sequence forward, all-gather backward."""

    def forward(self, x, mb=0):
        return self.tp.comm.reduce_scatter(x, axis=SEQ_AXIS) if self.active else x

    def backward_input(self, dy, mb=0):
        return self.tp.comm.allgather(dy, axis=SEQ_AXIS) if self.active else dy


class VocabParallelCrossEntropy(CrossEntropyLoss):
    """Mean softmax cross-entropy over logits split by vocabulary columns across tp.

    The math is ``nn.losses``'s; this wrapper gives it this rank's column offset and the
    all-reductions over tp. It never gathers the full logits (Megatron's vocab-parallel loss): the
    row max, the sum of exponentials and the target logit are each reduced over tp, so the message
    per token is a few scalars instead of V / tp logits.
    """

    def __init__(self, tp: TPContext):
        super().__init__()
        self.tp = tp

    def _offset(self, v_local: int) -> int:
        return self.tp.rank * v_local

    def _reduce(self, x, op):
        return self.tp.comm.allreduce(x, op=op, inplace=True) if self.tp.size > 1 else x


def _branch(name: str) -> str:
    """The region a linear belongs to ("blocks.0.attn.qkv" -> "blocks.0.attn"): where the
    block's f / g operators take their names."""
    return name.rsplit(".", 1)[0]


class Megatron1DLayers:
    """The layers of Megatron's 1D cut for ``mpipar.models``' description: a column linear is
    f then the linear (output columns split), a row linear is the linear (input rows split),
    g, then its bias added once; LayerNorm and positions replicated (partial gradients under
    sequence parallelism); the token table split by vocabulary rows."""

    def __init__(self, tp: TPContext, pf):
        self.tp, self.pf = tp, pf
        self.split = tp.split

    def norm(self, part) -> Layer:
        return LayerNorm(self.pf, part.name, part.d, partial_grad=self.tp.sequence_parallel)

    def linear(self, part) -> list[Layer]:
        w, b = part.w_shape, part.b_shape
        if part.cut == "column":
            return [self.tp.enter(f"{_branch(part.name)}.f"),
                    Linear(self.pf, part.name, part.d_in, part.d_out, bias=part.bias,
                           w_shape=w, b_shape=b, w_spec=ShardSpec(axis=len(w) - 1),
                           b_spec=ShardSpec(axis=len(b) - 1))]
        out = [Linear(self.pf, part.name, part.d_in, part.d_out, bias=False, w_shape=w,
                      w_spec=self.tp.row), self.tp.leave(f"{_branch(part.name)}.g")]
        if part.bias:
            out.append(Bias(self.pf, part.name, part.d_out,
                            spec=ShardSpec(None, partial_grad=self.tp.sequence_parallel)))
        return out

    def tied_head(self, part, table) -> list[Layer]:
        """The head reading the embedding's table (its row shard is the head's column shard)."""
        return [self.tp.enter(f"{_branch(part.name)}.f"), TiedHead(table, name=part.name)]

    def attention(self, part) -> Layer:
        return CausalSelfAttention(part.n_head // self.split.heads, part.head_dim, name=part.name)

    def embedding(self, tok, pos):
        """(the embedding unit, its table): masked lookups summed over the vocabulary shards."""
        sp = self.tp.sequence_parallel
        layer = Embedding(self.pf, tok.name, tok.vocab, tok.d, spec=ShardSpec(axis=0))
        unit = Sequential([
            layer,
            self.tp.leave("embed.g"),
            PositionEmbedding(self.pf, pos.name, pos.max_len, pos.d,
                              shard_index=self.tp.rank if sp else 0, partial_grad=sp),
        ], name="embed")
        return unit, layer.table

    def loss(self):
        return VocabParallelCrossEntropy(self.tp)
