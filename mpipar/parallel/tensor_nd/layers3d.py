"""The 3D layers (arXiv 2105.14450): linear, LayerNorm, embeddings and the vocab-parallel loss on
a q x q x q cube. Same contract as ``nn.layers``; the weightless layers run unchanged.

A linear of input parity p (hidden dim a, token-piece dim c; see ``context3d``) and weight block
(rows a, columns c), its rows cut once more over i:
  forward   X = all-gather over c of x (tokens block i), W = all-gather over i of the weight
            piece, y = reduce-scatter over a of X @ W (tokens): parity 1 - p;
  backward  dY = all-gather over a of dy, dx = reduce-scatter over c of dY @ W^T;
            dW = reduce-scatter over i of X^T dY (X gathered again: nothing q times larger
            is kept between passes except dY, from B to W).
Vectors along the hidden axis (biases, LayerNorm, positions) are cut by one dim only and
replicated over the two others by design; their gradients are summed over those here.
"""

from __future__ import annotations

from ...backend import array_module
from ...nn import functional as F
from ...nn.layers import Layer, ParamFactory
from ...nn.losses import CrossEntropyLoss
from .context3d import PARITY, TP3DContext
from .layers2d import LayerNormND, PositionEmbeddingND


def _rows(x):
    return x.reshape(-1, x.shape[-1])


class Linear3D(Layer):
    """y = x @ W (+ b) by the 3D product. ``w_shape``/``axes`` describe a fused weight (q/k/v:
    full (d, 3, d), rows on axis 0, columns on axis 2)."""

    def __init__(self, pf: ParamFactory, tp: TP3DContext, name, d_in, d_out, parity, bias=True,
                 w_shape=None, axes=(0, 1), b_shape=None, b_axis=0):
        super().__init__(name)
        self.tp = tp
        self.a, self.c = PARITY[parity]  # hidden dim in, token-piece dim in (= hidden out)
        rows, cols = axes
        self.w = pf.make(f"{name}.weight", w_shape or (d_in, d_out), "weight",
                         tp.spec((rows, self.a), (rows, "i"), (cols, self.c)))
        self.b = (pf.make(f"{name}.bias", b_shape or (d_out,), "bias",
                          tp.spec((b_axis, self.c)), init="zeros") if bias else None)
        self.own_params = [self.w] + ([self.b] if bias else [])

    def _weight(self):
        w = self.tp.ci.allgather(self.w.data, axis=0)
        return w.reshape(w.shape[0], -1)

    def forward(self, x, mb=0):
        self._ctx[mb] = [x, None]
        xg = self.tp.along(self.c).allgather(x, axis=0)
        y = _rows(xg) @ self._weight()
        y = self.tp.along(self.a).reduce_scatter(y.reshape(*xg.shape[:-1], -1), axis=0)
        if self.b is not None:
            y += self.b.data.reshape(-1)
        return y

    def backward_input(self, dy, mb=0):
        dyg = self.tp.along(self.a).allgather(dy, axis=0)
        self._ctx[mb][1] = dyg
        dx = _rows(dyg) @ self._weight().T
        return self.tp.along(self.c).reduce_scatter(dx.reshape(*dyg.shape[:-1], -1), axis=0)

    def backward_weight(self, mb=0):
        x, dyg = self._ctx.pop(mb)
        xg = self.tp.along(self.c).allgather(x, axis=0)
        dyg2 = _rows(dyg)
        dw = self.tp.ci.reduce_scatter(_rows(xg).T @ dyg2, axis=0)
        self.w.grad.reshape(dw.shape)[...] += dw
        if self.b is not None:  # dY holds all of tokens block i: sum the q blocks over i
            self.b.grad.reshape(-1)[...] += self.tp.sum_over(dyg2.sum(axis=0), "i")


class LayerNorm3D(LayerNormND):
    """LayerNorm of parity-0 activations (hidden cut over l): moments all-reduced over l."""

    def __init__(self, pf: ParamFactory, tp: TP3DContext, name, d, eps=1e-5):
        self.hid, self.piece = PARITY[0]
        super().__init__(pf, tp, name, d, eps, self.hid)

    def _mean(self, s):
        return self.tp.along(self.hid).allreduce(s, op="sum", inplace=True) / self.d

    def _sum_grads(self, both):
        return self.tp.sum_over(both, "i", self.piece)


class Embedding3D(Layer):
    """Token embedding, table (vocab, d): vocab cut over j then i (q^2 blocks), hidden over l.
    Each rank looks up every sequence in its vocabulary block; reduce-scatters over i then j sum
    the q^2 blocks and leave rank (i, j, l) tokens block i, piece j (parity 0)."""

    def __init__(self, pf: ParamFactory, tp: TP3DContext, name, vocab, d):
        super().__init__(name)
        self.tp = tp
        self.table = pf.make(f"{name}.weight", (vocab, d), "embedding",
                             tp.spec((0, "j"), (0, "i"), (1, "l")))
        self.own_params = [self.table]
        rows = self.table.spec.block_index(self.table.full_shape, tp.rank)[0]
        self.lo, self.hi = rows.start, rows.stop

    def forward(self, ids, mb=0):
        xp = array_module(self.table.data)
        ids = xp.asarray(ids)
        outside = (ids < self.lo) | (ids >= self.hi)
        local = ids - self.lo
        local[outside] = 0
        y = F.embedding_forward(local, self.table.data)
        y[outside] = 0.0
        self._ctx[mb] = [local, outside, None]
        return self.tp.cj.reduce_scatter(self.tp.ci.reduce_scatter(y, axis=0), axis=0)

    def backward_input(self, dy, mb=0):
        self._ctx[mb][2] = dy
        return None

    def backward_weight(self, mb=0):
        local, outside, dy = self._ctx.pop(mb)
        dy = self.tp.ci.allgather(self.tp.cj.allgather(dy, axis=0), axis=0)
        dy[outside] = 0.0
        F.embedding_backward_weight(local, dy, self.table.grad)


class PositionEmbedding3D(PositionEmbeddingND):
    """y = x + P[:s] on parity 0, P (max_len, d) cut over l; its gradient summed over i, j."""

    def __init__(self, pf: ParamFactory, tp: TP3DContext, name, max_len, d):
        super().__init__(pf, tp, name, max_len, d, "l")

    def _accumulate(self, grad, g):
        grad += self.tp.sum_over(g, "i", "j")


class CrossEntropy3D(CrossEntropyLoss):
    """Vocab-parallel cross-entropy on parity-1 logits (tokens block i, piece l; vocab block j):
    reduced over j; the micro-batch mean is the mean of the q^2 token blocks' means."""

    def __init__(self, tp: TP3DContext):
        super().__init__()
        self.tp = tp

    def _offset(self, v_local: int) -> int:
        return self.tp.cj.rank * v_local

    def _reduce(self, x, op):
        return self.tp.cj.allreduce(x, op=op, inplace=True)

    def forward(self, logits, targets, mb=0, scale=1.0) -> float:
        nb, n, blk = logits.shape[0], self.tp.batch_shards, self.tp.batch_block(1)
        loss = super().forward(logits, targets[blk * nb:(blk + 1) * nb], mb, scale / n)
        loss = self.tp.cl.allreduce_scalar(self.tp.ci.allreduce_scalar(loss, "sum"), "sum")
        return loss / n
