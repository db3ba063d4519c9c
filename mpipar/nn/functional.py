"""Hand-written kernels: forward and backward of every operation, on any array module.

Pure functions of arrays. The array module comes from the arrays themselves (``array_module``), so
the same code runs with NumPy and CuPy. Scalars are Python floats so that NumPy 2's promotion
rules keep float32 arrays float32 (``float32_array * np.float64(x)`` would become float64).

Speed on the CPU (BENCHMARKS.md has the profiles). NumPy runs one pass over memory per operation,
so a chain of element-wise operations on arrays larger than the cache streams them from main
memory again and again. The chains here (GELU, LayerNorm, softmax attention) therefore run over
cache-sized blocks of rows, writing into outputs allocated once per call (and reused across calls
when no one holds them any more, see ``_empty``). Per row the arithmetic is the same whatever the
blocking, so results do not depend on the block size. On a GPU (CuPy) each chain runs once over
the whole array: one kernel per operation is what it wants.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..backend import array_module

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


# ----- CPU execution: cache-sized blocks, reused buffers -----------------------------------------

BLOCK_ELEMENTS = 1 << 15  # 128 KiB of float32: the few arrays a chain touches stay in L2
POOL_PER_SHAPE = 64  # at most this many idle-or-busy buffers kept per (shape, dtype)
_pool: dict = {}


def _empty(xp, shape, dtype):
    """An uninitialised array, on the CPU reused from earlier calls when nothing else refers to
    it any more (CPython's reference count says so: a saved context, a view or a caller holding
    it keeps it out of reach). Fresh multi-megabyte arrays cost page faults on every step;
    reused ones are already mapped. CuPy has its own pool."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    key = (tuple(shape), np.dtype(dtype).str)
    bufs = _pool.setdefault(key, [])
    for buf in bufs:
        if sys.getrefcount(buf) == 3:  # bufs, the loop variable, getrefcount's argument
            return buf
    buf = np.empty(shape, dtype=dtype)
    if len(bufs) < POOL_PER_SHAPE:
        bufs.append(buf)
    return buf


def clear_pool() -> None:
    """Forget the reusable buffers (frees them once nothing else holds them)."""
    _pool.clear()


def _run(items, fn) -> None:
    """fn(item) for every block, in order. (Python threads over the blocks were tried and lost:
    GIL hand-offs between short NumPy calls, and OpenBLAS workers spinning after each product,
    cost more than the second core gave; BENCHMARKS.md.)"""
    for it in items:
        fn(it)


def _row_blocks(xp, n_rows: int, row_len: int) -> list:
    """Slices of rows, about BLOCK_ELEMENTS each; one slice of everything on a GPU."""
    if xp is not np:
        return [slice(0, n_rows)]
    step = max(1, BLOCK_ELEMENTS // max(1, row_len))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _rows(a):
    """``a`` as a 2-D (rows, last axis) array: a view when ``a`` is contiguous."""
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


# ----- linear ---------------------------------------------------------------------------------

def linear_forward(x, w, b=None):
    """y = x @ w (+ b); x (..., in), w (in, out), b (out,).

    Leading axes are flattened so that BLAS sees one (tokens, in) @ (in, out) product.
    """
    xp = array_module(x)
    x2 = _rows(x)
    y = xp.matmul(x2, w, out=_empty(xp, (x2.shape[0], w.shape[-1]), x2.dtype))
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[-1])


def linear_backward_input(dy, w):
    """dx = dy @ w.T"""
    xp = array_module(dy)
    dy2 = _rows(dy)
    dx = xp.matmul(dy2, w.T, out=_empty(xp, (dy2.shape[0], w.shape[0]), dy2.dtype))
    return dx.reshape(*dy.shape[:-1], w.shape[0])


def linear_backward_weight(x, dy, dw, db=None):
    """dw += x.T @ dy, db += sum(dy) over all leading axes (accumulating, for micro-batches)."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw += x2.T @ dy2
    if db is not None:
        db += dy2.sum(axis=0)


# ----- activations ----------------------------------------------------------------------------

def gelu_forward(x):
    """GELU, tanh approximation. Returns (y, t) where t = tanh(...) is kept for the backward."""
    xp = array_module(x)
    x2 = _rows(x)
    y, t = _empty(xp, x2.shape, x2.dtype), _empty(xp, x2.shape, x2.dtype)

    def block(r):
        xb, tb, yb = x2[r], t[r], y[r]
        # tanh argument c (x + a x^3) = x (c + c a x^2): x*x*x, not x**3 (integer powers are
        # ~100x slower in NumPy), and the constants folded so that it costs four passes
        xp.multiply(xb, xb, out=tb)
        tb *= GELU_C * GELU_A
        tb += GELU_C
        tb *= xb
        xp.tanh(tb, out=tb)
        xp.multiply(tb, xb, out=yb)  # 0.5 x (1 + t) = 0.5 (x t + x)
        yb += xb
        yb *= 0.5

    _run(_row_blocks(xp, *x2.shape), block)
    return y.reshape(x.shape), t.reshape(x.shape)


def gelu_backward(dy, x, t):
    """d/dx of 0.5 x (1 + tanh(c (x + a x^3))) = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2).

    Per block: s = 0.5 c x (1 + 3 a x^2) (t^2 - 1), then g = (0.5 t + 0.5 - s) * dy.
    """
    xp = array_module(x)
    x2, t2, dy2 = _rows(x), _rows(t), _rows(dy)
    g = _empty(xp, x2.shape, x2.dtype)

    def block(r):
        xb, tb, gb = x2[r], t2[r], g[r]
        s = xb * xb
        s *= 1.5 * GELU_C * GELU_A
        s += 0.5 * GELU_C
        s *= xb
        xp.multiply(tb, tb, out=gb)
        gb -= 1.0
        s *= gb
        xp.multiply(tb, 0.5, out=gb)
        gb += 0.5
        gb -= s
        gb *= dy2[r]

    _run(_row_blocks(xp, *x2.shape), block)
    return g.reshape(x.shape)


def relu_forward(x):
    xp = array_module(x)
    return xp.maximum(x, 0.0)


def relu_backward(dy, x):
    return dy * (x > 0)


# ----- layer norm -----------------------------------------------------------------------------

def layernorm_forward(x, gamma, beta, eps=1e-5):
    """Normalise over the last axis. Returns (y, xhat, rstd)."""
    xp = array_module(x)
    x2 = _rows(x)
    y, xhat = _empty(xp, x2.shape, x2.dtype), _empty(xp, x2.shape, x2.dtype)
    rstd = xp.empty((x2.shape[0], 1), dtype=x2.dtype)

    def block(r):
        xb, hb, yb, rb = x2[r], xhat[r], y[r], rstd[r]
        xp.subtract(xb, xb.mean(axis=-1, keepdims=True), out=hb)
        xp.multiply(hb, hb, out=yb)  # y's block as scratch for the squares
        xp.mean(yb, axis=-1, keepdims=True, out=rb)
        rb += eps
        xp.sqrt(rb, out=rb)
        xp.reciprocal(rb, out=rb)
        hb *= rb
        xp.multiply(hb, gamma, out=yb)
        yb += beta

    _run(_row_blocks(xp, *x2.shape), block)
    return y.reshape(x.shape), xhat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def layernorm_backward_input(dy, xhat, rstd, gamma):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma."""
    xp = array_module(dy)
    dy2, h2, r2 = _rows(dy), _rows(xhat), rstd.reshape(-1, 1)
    g = _empty(xp, dy2.shape, dy2.dtype)

    def block(r):
        gb, hb = g[r], h2[r]
        xp.multiply(dy2[r], gamma, out=gb)
        m1 = gb.mean(axis=-1, keepdims=True)
        gh = gb * hb
        m2 = gh.mean(axis=-1, keepdims=True)
        gb -= m1
        xp.multiply(hb, m2, out=gh)
        gb -= gh
        gb *= r2[r]

    _run(_row_blocks(xp, *dy2.shape), block)
    return g.reshape(dy.shape)


def layernorm_backward_weight(dy, xhat, dgamma, dbeta):
    h = dy.shape[-1]
    dgamma += (dy * xhat).reshape(-1, h).sum(axis=0)
    dbeta += dy.reshape(-1, h).sum(axis=0)


# ----- embedding ------------------------------------------------------------------------------

def embedding_forward(ids, table):
    return table[ids]


def embedding_backward_weight(ids, dy, dtable):
    """dtable[ids] += dy, with repeated ids summed."""
    xp = array_module(dtable)
    xp.add.at(dtable, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))


# ----- attention ------------------------------------------------------------------------------

def softmax_lastaxis_(s):
    """Numerically stable softmax over the last axis, in place."""
    xp = array_module(s)
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    r = s.sum(axis=-1, keepdims=True)
    xp.reciprocal(r, out=r)  # one division per row, then a multiply per element
    s *= r
    return s


def causal_mask(xp, s_q, s_k):
    """True where the query may NOT attend (key position after query position)."""
    return xp.triu(xp.ones((s_q, s_k), dtype=bool), k=1 + s_k - s_q)


def _masked_value(dtype):
    return -1e30 if dtype.itemsize >= 8 else -3e38  # large finite: exp gives exact 0


QUERY_TILE = 32  # query rows per causal tile (fixed, so results do not depend on BLOCK_ELEMENTS)


def _causal_tiles(xp, mask, s_q, s_k):
    """How to skip the masked upper triangle: (query tiles, key tiles).

    Query tile (q0, q1, ke): rows q0:q1 see keys 0:ke only (their scores beyond ke are masked, so
    their probabilities are exactly 0 and are written as 0 without computing them). Key tile
    (k0, k1, qs): keys k0:k1 are seen by queries qs: only. With tiles of 32 rows this computes
    (1 + 1/n_tiles) / 2 of the S x S scores: 62 % at S = 128, 56 % at S = 256. At two BLAS
    threads it also helps as much again: OpenBLAS runs products with M N K <= 2^18 (a 32 x 128 x 32
    tile) on the calling thread, and threading the full 128 x 128 x 32 ones cost more in hand-offs
    than it gained. The tile size is fixed, not derived from BLOCK_ELEMENTS, so the rounding does
    not depend on the cache blocks. Only for the standard causal mask (any other mask, and the
    GPU, get one tile: the full product)."""
    off = s_k - s_q
    if (xp is not np or mask.ndim != 2 or tuple(mask.shape) != (s_q, s_k) or off < 0
            or s_q <= QUERY_TILE or not np.array_equal(mask, causal_mask(np, s_q, s_k))):
        return [(0, s_q, s_k)], [(0, s_k, 0)]
    t = QUERY_TILE
    qt = [(q0, min(q0 + t, s_q), min(q0 + t, s_q) + off) for q0 in range(0, s_q, t)]
    kt = [(k0, min(k0 + t, s_k), max(0, k0 - off)) for k0 in range(0, s_k, t)]
    return qt, kt


def _head_blocks(xp, lead, per_head):
    """Index tuples over the leading (batch..., heads) axes ``lead`` of an attention tensor:
    groups of heads of about BLOCK_ELEMENTS elements (``per_head`` each) on the CPU, everything
    at once on a GPU. Each tuple selects a (heads, S, ...) block, so strided q/k/v views need no
    copies."""
    if xp is not np or not lead:
        return [(Ellipsis,)]
    per = max(1, BLOCK_ELEMENTS // max(1, per_head))
    outer = [()]
    for n in lead[:-1]:
        outer = [o + (i,) for o in outer for i in range(n)]
    nh = lead[-1]
    return [o + (slice(h, min(h + per, nh)),) for o in outer for h in range(0, nh, per)]


def attention_forward(q, k, v, mask, out=None):
    """Causal attention on (B, H, S, D) tensors. Returns (out, probs).

    The 1/sqrt(D) scale goes on q (S*D elements) rather than on the scores (S*S). ``out``, if
    given, is a (B, H, S, D) view to write the result into (say, a transposed view of the
    (B, S, H*D) array the next layer takes), which saves a copy. With the standard causal mask
    the CPU computes only the query tiles' visible keys (``_causal_tiles``); probs is complete
    all the same (zeros above the diagonal).
    """
    xp = array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = q.shape[-2], k.shape[-2]
    p = _empty(xp, (*q.shape[:-1], s_k), q.dtype)
    if out is None:
        out = xp.empty(q.shape, dtype=q.dtype)
    fill = _masked_value(p.dtype)
    qtiles, _ = _causal_tiles(xp, mask, s_q, s_k)

    def block(ix):
        qb, kb, vb, pb, ob = q[ix] * scale, k[ix], v[ix], p[ix], out[ix]
        for q0, q1, ke in qtiles:
            pt = pb[..., q0:q1, :ke]
            xp.matmul(qb[..., q0:q1, :], kb[..., :ke, :].swapaxes(-1, -2), out=pt)
            # copyto with a broadcast mask: ~20x faster in NumPy than pt[..., mask] = value
            xp.copyto(pt, fill, where=mask[q0:q1, :ke])
            softmax_lastaxis_(pt)
            xp.matmul(pt, vb[..., :ke, :], out=ob[..., q0:q1, :])
            if ke < s_k:
                pb[..., q0:q1, ke:].fill(0.0)

    _run(_head_blocks(xp, q.shape[:-2], (qtiles[0][1] - qtiles[0][0]) * s_k), block)
    return out, p


def attention_backward(dout, q, k, v, p, out=None, dq=None, dk=None, dv=None, mask=None):
    """Gradients of q, k, v for attention_forward.

    ``out`` (the forward's result, if still at hand) makes the softmax backward's row term
    sum_j dp_ij p_ij = dout_i . out_i an S*D product instead of an S*S one (FlashAttention's D
    term). ``dq``, ``dk``, ``dv``, if given, are (B, H, S, D) views the gradients are written into.
    ``mask``, if given, is the forward's mask: with the standard causal one the CPU skips the
    upper triangle as the forward does (probs are exactly 0 there, so the result is the same).
    """
    xp = array_module(dout)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = p.shape[-2], p.shape[-1]
    dq = xp.empty(q.shape, dtype=q.dtype) if dq is None else dq
    dk = xp.empty(k.shape, dtype=k.dtype) if dk is None else dk
    dv = xp.empty(v.shape, dtype=v.dtype) if dv is None else dv
    if mask is None:
        qtiles, ktiles = [(0, s_q, s_k)], [(0, s_k, 0)]
    else:
        qtiles, ktiles = _causal_tiles(xp, mask, s_q, s_k)

    def block(ix):
        # the 1/sqrt(D) of dq = scale ds k and dk = scale ds^T q goes on (contiguous copies of)
        # k and q, S*D elements each, instead of on dq and dk, strided views into the caller's
        # fused gradient (a slow pass each)
        pb, db, vb = p[ix], dout[ix], v[ix]
        qb, kb = q[ix] * scale, k[ix] * scale
        dqb, dkb, dvb = dq[ix], dk[ix], dv[ix]
        ds = _empty(xp, pb.shape, pb.dtype)
        rows = None if out is None else (db * out[ix]).sum(axis=-1, keepdims=True)
        # per query tile: dp = dout v^T, ds = p * (dp - sum_j(dp * p)), dq = ds k
        for q0, q1, ke in qtiles:
            pt, dt = pb[..., q0:q1, :ke], ds[..., q0:q1, :ke]
            xp.matmul(db[..., q0:q1, :], vb[..., :ke, :].swapaxes(-1, -2), out=dt)
            if rows is not None:
                dt -= rows[..., q0:q1, :]
            else:
                dt -= (dt * pt).sum(axis=-1, keepdims=True)
            dt *= pt
            xp.matmul(dt, kb[..., :ke, :], out=dqb[..., q0:q1, :])
            if ke < s_k:
                ds[..., q0:q1, ke:].fill(0.0)
        # per key tile: dv = p^T dout, dk = ds^T q over the queries that see those keys
        for k0, k1, qs in ktiles:
            xp.matmul(pb[..., qs:, k0:k1].swapaxes(-1, -2), db[..., qs:, :], out=dvb[..., k0:k1, :])
            xp.matmul(ds[..., qs:, k0:k1].swapaxes(-1, -2), qb[..., qs:, :], out=dkb[..., k0:k1, :])

    _run(_head_blocks(xp, p.shape[:-2], (qtiles[0][1] - qtiles[0][0]) * s_k), block)
    return dq, dk, dv


# ----- losses ---------------------------------------------------------------------------------

def cross_entropy_forward(logits, targets):
    """Mean softmax cross-entropy over rows. logits (N, V), targets (N,) ints.

    Returns (loss, probs) with probs the softmax (kept for the backward).
    """
    xp = array_module(logits)
    n = logits.shape[0]
    z = logits - logits.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(z).sum(axis=-1))
    picked = z[xp.arange(n), targets]
    loss = float((lse - picked).mean())
    p = z
    xp.exp(z, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return loss, p


def cross_entropy_backward(probs, targets, scale=1.0):
    """d(scale * mean CE)/dlogits = scale * (p - onehot) / N."""
    xp = array_module(probs)
    n = probs.shape[0]
    d = probs.copy()
    d[xp.arange(n), targets] -= 1.0
    d *= scale / n
    return d


def mse_forward(y, target):
    """Mean squared error over all elements. Returns (loss, diff), diff kept for the backward."""
    diff = y - target
    return float((diff * diff).mean()), diff


def mse_backward(diff, scale=1.0):
    return diff * (2.0 * scale / diff.size)
