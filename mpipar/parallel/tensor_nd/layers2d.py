"""The 2D (Optimus) layers: linear, LayerNorm, embeddings and the vocab-parallel loss on q x q
blocks. Same contract as ``nn.layers`` (forward, backward_input, backward_weight keyed by the
micro-batch); the weightless layers (GELU, attention core, residual) run unchanged on the blocks.

Activations are (batch / q, seq, hidden / q) on rank (i, j): batch block i, hidden block j.
Parameters are full-shape masters cut by a two-axis ``ShardSpec``; vectors along the hidden axis
(biases, LayerNorm, positions) are cut by column j only and so replicated over the q ranks of a
column, each seeing its own batch block: their gradients are summed over the column here, in
``backward_weight``, so every copy stays equal and the optimizer needs nothing new.
"""

from __future__ import annotations

from ...backend import array_module
from ...nn import functional as F
from ...nn.layers import Layer, ParamFactory
from ...nn.losses import CrossEntropyLoss
from . import summa
from .context import COL, ROW, TP2DContext


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _col_sum_into(tp, grad, local):
    """grad += the sum over this column's ranks (and depth, 2.5D) of ``local`` (their batch
    blocks' shares)."""
    grad += tp.sum_replicas(local)


class Linear2D(Layer):
    """y = x @ W (+ b) by SUMMA. ``w_shape``/``w_split`` describe a fused weight (q/k/v: full
    (d, 3, d) cut on axes 0 and 2, so that column block j holds whole heads of q, k and v)."""

    def __init__(self, pf: ParamFactory, tp: TP2DContext, name, d_in, d_out, bias=True,
                 w_shape=None, w_split=((0, ROW), (1, COL)), b_shape=None, b_split=((0, COL),)):
        super().__init__(name)
        self.tp = tp
        self.w = pf.make(f"{name}.weight", w_shape or (d_in, d_out), "weight", tp.spec(*w_split))
        self.b = (pf.make(f"{name}.bias", b_shape or (d_out,), "bias", tp.spec(*b_split),
                          init="zeros") if bias else None)
        self.own_params = [self.w] + ([self.b] if bias else [])

    def _w(self, a):
        return a.reshape(a.shape[0], -1)

    def forward(self, x, mb=0):
        self._ctx[mb] = [x, None]
        y = summa.ab(_rows(x), self._w(self.w.data), self.tp)
        if self.b is not None:
            y += self.b.data.reshape(-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def backward_input(self, dy, mb=0):
        self._ctx[mb][1] = dy
        dx = summa.abt(_rows(dy), self._w(self.w.data), self.tp)
        return dx.reshape(*dy.shape[:-1], dx.shape[-1])

    def backward_weight(self, mb=0):
        x, dy = self._ctx.pop(mb)
        dy2 = _rows(dy)
        dw = summa.atb(_rows(x), dy2, self.tp)
        if self.tp.d > 1:  # 2.5D: every depth layer holds the same blocks, each its own slab
            self.tp.dep.allreduce(dw, op="sum", inplace=True)
        self._w(self.w.grad)[...] += dw
        if self.b is not None:
            _col_sum_into(self.tp, self.b.grad.reshape(-1), dy2.sum(axis=0))


class LayerNormND(Layer):
    """LayerNorm over a hidden axis cut over one grid dim (``cut``): the ranks along it together
    hold a token's whole hidden vector, so the mean and the variance (two passes, as on one
    rank) and the backward's two means are sums all-reduced along it. A subclass says which
    communicator that is (``_mean``) and over which dims the parameter gradients are summed
    (``_sum_grads``)."""

    def __init__(self, pf: ParamFactory, tp, name, d, eps, cut):
        super().__init__(name)
        self.tp, self.d, self.eps = tp, d, eps
        spec = tp.spec((0, cut))
        self.g = pf.make(f"{name}.weight", (d,), "norm", spec, init="ones")
        self.b = pf.make(f"{name}.bias", (d,), "norm", spec, init="zeros")
        self.own_params = [self.g, self.b]

    def _mean(self, s):
        raise NotImplementedError

    def _sum_grads(self, both):
        raise NotImplementedError

    def forward(self, x, mb=0):
        xp = array_module(x)
        x2 = _rows(x)
        xc = x2 - self._mean(xp.ascontiguousarray(x2.sum(axis=1)))[:, None]
        var = self._mean(xp.ascontiguousarray((xc * xc).sum(axis=1)))
        rstd = 1.0 / xp.sqrt(var + self.eps)
        xhat = xc * rstd[:, None]
        self._ctx[mb] = [xhat, rstd, None]
        return (xhat * self.g.data + self.b.data).reshape(x.shape)

    def backward_input(self, dy, mb=0):
        xp = array_module(dy)
        ctx = self._ctx[mb]
        ctx[2] = dy
        xhat, rstd = ctx[0], ctx[1]
        g = _rows(dy) * self.g.data
        # both means in one message: (2, tokens)
        m = self._mean(xp.stack([g.sum(axis=1), (g * xhat).sum(axis=1)]))
        dx = rstd[:, None] * (g - m[0][:, None] - xhat * m[1][:, None])
        return dx.reshape(dy.shape)

    def backward_weight(self, mb=0):
        xp = array_module(self.g.grad)
        xhat, _, dy = self._ctx.pop(mb)
        dy2 = _rows(dy)
        both = self._sum_grads(xp.stack([(dy2 * xhat).sum(axis=0), dy2.sum(axis=0)]))
        self.g.grad += both[0]
        self.b.grad += both[1]


class LayerNorm2D(LayerNormND):
    """Hidden cut into q column blocks: moments all-reduced over the row; gradients summed
    over the replicas (the rows, and depth in 2.5D)."""

    def __init__(self, pf: ParamFactory, tp: TP2DContext, name, d, eps=1e-5):
        super().__init__(pf, tp, name, d, eps, COL)

    def _mean(self, s):
        return self.tp.row.allreduce(s, op="sum", inplace=True) / self.d

    def _sum_grads(self, both):
        return self.tp.sum_replicas(both)


class Embedding2D(Layer):
    """Token embedding, table (vocab, d) cut vocab by row i and hidden by column j.

    Every rank gets all of the micro-batch's ids: rank (i', j) looks up (masked) every sequence
    of its depth's slab (all of them in 2D) in its vocabulary rows, and a reduce-scatter over
    column j sums the q vocabulary shards and hands rank (i, j) its batch block i. The backward
    all-gathers the gradient over the column (and, 2.5D, sums the table's over depth).
    """

    def __init__(self, pf: ParamFactory, tp: TP2DContext, name, vocab, d):
        super().__init__(name)
        self.tp = tp
        self.table = pf.make(f"{name}.weight", (vocab, d), "embedding",
                             tp.spec((0, ROW), (1, COL)))
        self.own_params = [self.table]
        self.lo = tp.i * self.table.shape[0]
        self.hi = self.lo + self.table.shape[0]

    def forward(self, ids, mb=0):
        xp = array_module(self.table.data)
        ids = xp.asarray(ids)
        slab = ids.shape[0] // self.tp.d
        ids = ids[self.tp.k * slab:(self.tp.k + 1) * slab]
        outside = (ids < self.lo) | (ids >= self.hi)
        local = ids - self.lo
        local[outside] = 0
        y = F.embedding_forward(local, self.table.data)
        y[outside] = 0.0
        self._ctx[mb] = [local, outside, None]
        return self.tp.col.reduce_scatter(y, axis=0)

    def backward_input(self, dy, mb=0):
        self._ctx[mb][2] = dy
        return None  # token ids have no gradient

    def backward_weight(self, mb=0):
        local, outside, dy = self._ctx.pop(mb)
        dy = self.tp.col.allgather(dy, axis=0)
        dy[outside] = 0.0
        if self.tp.d == 1:
            F.embedding_backward_weight(local, dy, self.table.grad)
            return
        xp = array_module(dy)
        g = xp.zeros_like(self.table.grad)
        F.embedding_backward_weight(local, dy, g)
        self.table.grad += self.tp.dep.allreduce(g, op="sum", inplace=True)


class PositionEmbeddingND(Layer):
    """y = x + P[:s], P (max_len, d) cut over one grid dim (``cut``); a subclass says how the
    gradient of a rank's block is summed over the grid dims that share it."""

    def __init__(self, pf: ParamFactory, tp, name, max_len, d, cut):
        super().__init__(name)
        self.tp = tp
        self.pos = pf.make(f"{name}.weight", (max_len, d), "embedding", tp.spec((1, cut)))
        self.own_params = [self.pos]

    def forward(self, x, mb=0):
        if x.shape[1] > self.pos.shape[0]:
            raise ValueError(f"sequence of {x.shape[1]} exceeds the context of "
                             f"{self.pos.shape[0]}: lower seq_len or raise block_size")
        return x + self.pos.data[:x.shape[1]]

    def backward_input(self, dy, mb=0):
        self._ctx[mb] = dy
        return dy

    def backward_weight(self, mb=0):
        xp = array_module(self.pos.grad)
        dy = self._ctx.pop(mb)
        self._accumulate(self.pos.grad[:dy.shape[1]], xp.ascontiguousarray(dy.sum(axis=0)))

    def _accumulate(self, grad, g):
        raise NotImplementedError


class PositionEmbedding2D(PositionEmbeddingND):
    """P cut by column j (hidden), the same for every batch block: gradients summed over it."""

    def __init__(self, pf: ParamFactory, tp: TP2DContext, name, max_len, d):
        super().__init__(pf, tp, name, max_len, d, COL)

    def _accumulate(self, grad, g):
        _col_sum_into(self.tp, grad, g)


class CrossEntropy2D(CrossEntropyLoss):
    """Vocab-parallel cross-entropy on logits (batch / q, seq, vocab / q): the row's ranks hold
    a token's whole vocabulary (reduced over the row, as 1D reduces over tp); each row holds a
    batch block, so the micro-batch mean is the mean over the column (and depth) of the blocks'
    means."""

    def __init__(self, tp: TP2DContext):
        super().__init__()
        self.tp = tp

    def _offset(self, v_local: int) -> int:
        return self.tp.j * v_local

    def _reduce(self, x, op):
        return self.tp.row.allreduce(x, op=op, inplace=True)

    def forward(self, logits, targets, mb=0, scale=1.0) -> float:
        nb, n = logits.shape[0], self.tp.batch_shards
        mine = targets[self.tp.batch_block * nb:(self.tp.batch_block + 1) * nb]
        loss = self.tp.col.allreduce_scalar(super().forward(logits, mine, mb, scale / n), "sum")
        return (self.tp.dep.allreduce_scalar(loss, "sum") if self.tp.d > 1 else loss) / n
