"""Layers: parameters plus the saved context of every micro-batch in flight.

"Split backward" (docs/architecture.md). A layer exposes ``forward(x, mb)``,
``backward_input(dy, mb)`` (returns dx) and ``backward_weight(mb)`` (accumulates into
``param.grad``); ``backward`` is both; ``backward_no_dx(dy, mb)`` is ``backward_input`` where
dx is not needed (the model's first chunk: its input is data). ``mb`` keys the saved context,
so a pipeline can hold many micro-batches at once and a zero-bubble schedule can run W long
after B. Inputs are kept by reference, never copied: the caller must hand each micro-batch a
buffer of its own (the pipeline executor receives into fresh arrays).
"""

from __future__ import annotations

from ..backend import array_module
from . import cpu
from . import functional as F
from .base import Layer
from .params import REPLICATED, Parameter, ShardSpec
from .sequential import Sequential

__all__ = ["ParamFactory", "Layer", "Sequential", "Residual", "Linear", "TiedHead", "Bias",
           "LayerNorm", "GELU", "ReLU", "Embedding", "PositionEmbedding",
           "CausalSelfAttention", "set_selective_recompute"]


class ParamFactory:
    """Makes the parameters of one model on one rank: backend, seed, tensor-parallel position."""

    def __init__(self, backend, seed=0, tp_rank=0, tp_size=1, std=0.02):
        self.backend, self.seed = backend, seed
        self.tp_rank, self.tp_size, self.std = tp_rank, tp_size, std

    def make(self, name, full_shape, role, spec: ShardSpec = REPLICATED, init="normal", std=None):
        """``role``: "weight", "embedding", "bias" or "norm" (decides weight decay)."""
        return Parameter(name, full_shape, self.backend, role=role, spec=spec,
                         tp_rank=self.tp_rank, tp_size=self.tp_size, init=init,
                         std=self.std if std is None else std, seed=self.seed)


class Residual(Layer):
    """y = x + inner(x)."""

    def __init__(self, inner: Layer, name=""):
        super().__init__(name)
        self.inner = inner

    def children(self):
        return [self.inner]

    def forward(self, x, mb=0):
        y = self.inner.forward(x, mb)
        return F.add(y, x, out=y)

    def backward_input(self, dy, mb=0):
        dx = self.inner.backward_input(dy, mb)
        return F.add(dx, dy, out=dx)

    def backward_weight(self, mb=0):
        self.inner.backward_weight(mb)


class Linear(Layer):
    """y = x @ W (+ b), W acting as a (d_in, d_out) matrix. Specs say how W and b split over tp.

    ``w_shape`` / ``b_shape`` give the full parameter shapes when they are not plain (d_in, d_out):
    the fused q/k/v weight is (d, 3, d), split along its last axis so that each rank holds whole
    heads of q, k and v; the rank's shard is then viewed as a (d, 3 * d / tp) matrix.
    """

    dense_role = "linear"  # nn/dense.py: a plain linear of a dense stack (not its subclasses)

    def __init__(self, pf: ParamFactory, name, d_in, d_out, bias=True,
                 w_spec=REPLICATED, b_spec=REPLICATED, std=None, w_shape=None, b_shape=None):
        super().__init__(name)
        self.w = pf.make(f"{name}.weight", w_shape or (d_in, d_out), "weight", w_spec,
                         std=std)
        self.b = (pf.make(f"{name}.bias", b_shape or (d_out,), "bias", b_spec, init="zeros")
                  if bias else None)
        self.own_params = [self.w] + ([self.b] if bias else [])

    @staticmethod
    def _w(a):
        """``a`` as a (d_in, d_out) matrix: itself when it is one (every plain linear, on each
        call of a small model's hot path), else a view (parameters are contiguous)."""
        return a if a.ndim == 2 else a.reshape(a.shape[0], -1)

    def forward(self, x, mb=0):
        self._ctx[mb] = [x, None]
        w, b = self.w.data, self.b
        if b is not None:
            b = b.data if b.data.ndim == 1 else b.data.reshape(-1)
        return F.linear_forward(x, w if w.ndim == 2 else self._w(w), b)

    def backward_input(self, dy, mb=0):
        self._ctx[mb][1] = dy
        w = self.w.data
        return F.linear_backward_input(dy, w if w.ndim == 2 else self._w(w))

    def backward_no_dx(self, dy, mb=0):
        # the model's first linear: its dx (batch x d_in, often the widest product of a small
        # model's backward) would be thrown away
        self._ctx[mb][1] = dy

    def backward_weight(self, mb=0):
        x, dy = self._ctx.pop(mb)
        g = self.w.grad
        b = self.b
        if b is not None:
            b = b.grad if b.grad.ndim == 1 else b.grad.reshape(-1)
        F.linear_backward_weight(x, dy, g if g.ndim == 2 else self._w(g), b)


class TiedHead(Layer):
    """Logits from the token-embedding table: y = x @ E.T (weight tying, Press & Wolf 2017).

    Under tensor parallelism the table's row shard is exactly the head's column shard, so tying
    needs no communication when the embedding and the head live on the same pipeline stage.
    """

    def __init__(self, table: Parameter, name="head"):
        super().__init__(name)
        self.table = table  # not in own_params: the embedding owns it

    def forward(self, x, mb=0):
        self._ctx[mb] = [x, None]
        return x @ self.table.data.T

    def backward_input(self, dy, mb=0):
        self._ctx[mb][1] = dy
        return dy @ self.table.data

    def backward_weight(self, mb=0):
        x, dy = self._ctx.pop(mb)
        h = x.shape[-1]
        self.table.grad += dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, h)


class Bias(Layer):
    """y = x + b. Megatron's row-parallel linear adds its bias once, after the reduction."""

    def __init__(self, pf: ParamFactory, name, d, spec=REPLICATED):
        super().__init__(name)
        self.b = pf.make(f"{name}.bias", (d,), "bias", spec, init="zeros")
        self.own_params = [self.b]

    def forward(self, x, mb=0):
        # into a reused buffer (the block's output, a few MB: a fresh one costs page faults)
        xp = array_module(x)
        return F.add(x, self.b.data, out=cpu.empty(xp, x.shape, x.dtype))

    def backward_input(self, dy, mb=0):
        self._ctx[mb] = dy
        return dy

    def backward_weight(self, mb=0):
        dy = self._ctx.pop(mb)
        F.column_sums(dy.reshape(-1, dy.shape[-1]), self.b.grad)


class LayerNorm(Layer):
    def __init__(self, pf: ParamFactory, name, d, eps=1e-5, partial_grad=False):
        super().__init__(name)
        spec = ShardSpec(axis=None, partial_grad=partial_grad)
        self.g = pf.make(f"{name}.weight", (d,), "norm", spec, init="ones")
        self.b = pf.make(f"{name}.bias", (d,), "norm", spec, init="zeros")
        self.own_params = [self.g, self.b]
        self.eps = eps

    def forward(self, x, mb=0):
        y, xhat, rstd = F.layernorm_forward(x, self.g.data, self.b.data, self.eps)
        self._ctx[mb] = [xhat, rstd, None]
        return y

    def backward_input(self, dy, mb=0):
        ctx = self._ctx[mb]
        ctx[2] = dy
        return F.layernorm_backward_input(dy, ctx[0], ctx[1], self.g.data)

    def backward_weight(self, mb=0):
        xhat, _, dy = self._ctx.pop(mb)
        F.layernorm_backward_weight(dy, xhat, self.g.grad, self.b.grad)


class GELU(Layer):
    dense_role = "gelu"  # nn/dense.py

    def forward(self, x, mb=0):
        y, t = F.gelu_forward(x)
        self._ctx[mb] = (x, t)
        return y

    def backward_input(self, dy, mb=0):
        x, t = self._ctx.pop(mb)
        return F.gelu_backward(dy, x, t)


class ReLU(Layer):
    dense_role = "relu"  # nn/dense.py

    def forward(self, x, mb=0):
        # the output is kept, not the input: its positives are the input's (the same mask),
        # and the next layer keeps it anyway, so the input can go (one activation less held
        # per micro-batch until the backward)
        y = self._ctx[mb] = F.relu_forward(x)
        return y

    def backward_input(self, dy, mb=0):
        return F.relu_backward(dy, self._ctx.pop(mb))


class Embedding(Layer):
    """Token embedding over the rows [lo, hi) of the vocabulary (all of it when tp = 1).

    Ids outside this rank's rows give zero vectors (the vocab-parallel masked lookup); the sum over
    tensor-parallel ranks then gives every token its row exactly once.
    """

    def __init__(self, pf: ParamFactory, name, vocab, d, spec=REPLICATED):
        super().__init__(name)
        self.table = pf.make(f"{name}.weight", (vocab, d), "embedding", spec)
        self.own_params = [self.table]
        rows = self.table.shape[0]
        self.lo = pf.tp_rank * rows if spec.axis == 0 else 0
        self.hi = self.lo + rows
        self.vocab = vocab

    def forward(self, ids, mb=0):
        xp = array_module(self.table.data)
        ids = xp.asarray(ids)
        if self.lo == 0 and self.hi == self.vocab:
            self._ctx[mb] = [ids, None, None]
            return F.embedding_forward(ids, self.table.data)
        outside = (ids < self.lo) | (ids >= self.hi)
        local = ids - self.lo
        local[outside] = 0
        y = F.embedding_forward(local, self.table.data)
        y[outside] = 0.0
        self._ctx[mb] = [local, outside, None]
        return y

    def backward_input(self, dy, mb=0):
        self._ctx[mb][2] = dy
        return None  # token ids have no gradient

    def backward_weight(self, mb=0):
        local, outside, dy = self._ctx.pop(mb)
        if outside is not None:
            dy = dy.copy()
            dy[outside] = 0.0
        F.embedding_backward_weight(local, dy, self.table.grad)


class PositionEmbedding(Layer):
    """y = x + P[offset : offset + s]: learned positions.

    Under sequence parallelism a rank holds the ``shard_index``-th slice of the sequence, so its
    positions start at shard_index * s (s = the local length).
    """

    def __init__(self, pf: ParamFactory, name, max_len, d, shard_index=0, partial_grad=False):
        super().__init__(name)
        self.pos = pf.make(f"{name}.weight", (max_len, d), "embedding",
                           ShardSpec(None, partial_grad))
        self.own_params = [self.pos]
        self.shard_index = shard_index

    def _span(self, s):
        lo = self.shard_index * s
        if lo + s > self.pos.shape[0]:
            raise ValueError(f"sequence positions up to {lo + s} exceed the context of "
                             f"{self.pos.shape[0]}: lower seq_len or raise block_size")
        return lo, lo + s

    def forward(self, x, mb=0):
        lo, hi = self._span(x.shape[1])
        xp = array_module(x)  # into a reused buffer: a fresh one costs page faults
        return xp.add(x, self.pos.data[lo:hi], out=cpu.empty(xp, x.shape, x.dtype))

    def backward_input(self, dy, mb=0):
        self._ctx[mb] = dy
        return dy

    def backward_weight(self, mb=0):
        dy = self._ctx.pop(mb)
        lo, hi = self._span(dy.shape[1])
        self.pos.grad[lo:hi] += dy.sum(axis=0)


class CausalSelfAttention(Layer):
    """The weightless core of attention on this rank's heads.

    Input (B, S, 3 * n_local * hd) laid out as [q | k | v] per rank; output (B, S, n_local * hd).
    """

    selective = False  # True: keep q, k, v only; recompute scores and softmax in the backward

    def __init__(self, n_heads_local, head_dim, name="attn"):
        super().__init__(name)
        self.nh, self.hd = n_heads_local, head_dim
        self._masks = {}

    def _mask(self, xp, s):
        if s not in self._masks:
            self._masks[s] = F.causal_mask(xp, s, s)
        return self._masks[s]

    def forward(self, qkv, mb=0):
        xp = array_module(qkv)
        b, s, _ = qkv.shape
        # (B, S, 3, nh, hd) -> (3, B, nh, S, hd): views, no copies (BLAS takes the strides)
        t = qkv.reshape(b, s, 3, self.nh, self.hd).transpose(2, 0, 3, 1, 4)
        q, k, v = t[0], t[1], t[2]
        # the result goes straight into the (B, S, nh * hd) layout the projection reads
        y = cpu.empty(xp, (b, s, self.nh, self.hd), qkv.dtype)
        _, p = F.attention_forward(q, k, v, self._mask(xp, s), out=y.transpose(0, 2, 1, 3))
        y = y.reshape(b, s, self.nh * self.hd)
        # y is kept by reference for the backward's row term (no extra memory: the projection
        # keeps it too); like any saved input it must not be changed in place while in flight
        # selective recomputation: drop the S x S probabilities, rebuilt in the backward
        self._ctx[mb] = (q, k, v, None if self.selective else p, y)
        return y

    def backward_input(self, dy, mb=0):
        xp = array_module(dy)
        q, k, v, p, y = self._ctx.pop(mb)
        b, s, _ = dy.shape
        if p is None:  # the same arithmetic on the same inputs: the same probabilities, bitwise
            _, p = F.attention_forward(q, k, v, self._mask(xp, s))
        dout = dy.reshape(b, s, self.nh, self.hd).transpose(0, 2, 1, 3)
        out = y.reshape(b, s, self.nh, self.hd).transpose(0, 2, 1, 3)
        # gradients written straight into the fused (B, S, 3, nh, hd) layout of the input
        dqkv = cpu.empty(xp, (b, s, 3, self.nh, self.hd), dy.dtype)
        g = dqkv.transpose(2, 0, 3, 1, 4)
        F.attention_backward(dout, q, k, v, p, out=out, dq=g[0], dk=g[1], dv=g[2],
                             mask=self._mask(xp, s))
        return dqkv.reshape(b, s, 3 * self.nh * self.hd)


def set_selective_recompute(layers, on: bool = True) -> int:
    """Selective recomputation on every attention core under ``layers``; returns how many."""
    n, todo = 0, list(layers)
    while todo:
        layer = todo.pop()
        if isinstance(layer, CausalSelfAttention):
            layer.selective = on
            n += 1
        todo.extend(layer.children())
    return n
