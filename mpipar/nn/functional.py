"""Hand-written kernels: forward and backward of every operation, on any array module.

Pure functions of arrays. The array module comes from the arrays themselves (``array_module``), so
the same code runs with NumPy and CuPy. Scalars are Python floats so that NumPy 2's promotion
rules keep float32 arrays float32 (``float32_array * np.float64(x)`` would become float64).

Speed on the CPU (BENCHMARKS.md has the profiles). NumPy runs one pass over memory per operation,
so a chain of element-wise operations on arrays larger than the cache streams them from main
memory again and again. The chains here (GELU, LayerNorm, softmax attention) therefore run over
blocks of rows (or heads), on the rank's kernel threads when the arrays are large, writing into
outputs reused across calls when no one holds them any more (``mpipar.nn.cpu``, which also splits
the products). Per row the arithmetic is the same whatever the blocking and the threads, so
results do not depend on either. On a GPU (CuPy) each chain runs once over the whole array: one
kernel per operation is what it wants.
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import array_module
from . import cpu

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def _rows(a):
    """``a`` as a 2-D (rows, last axis) array: a view when ``a`` is contiguous."""
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


# every kernel here answers ``array_module`` inline for NumPy: a small model calls them several
# times per layer and micro-batch, and a Python call is much of their cost there
_ndarray = np.ndarray

# ----- linear ---------------------------------------------------------------------------------

def linear_forward(x, w, b=None):
    """y = x @ w (+ b); x (..., in), w (in, out), b (out,).

    Leading axes are flattened so that BLAS sees one (tokens, in) @ (in, out) product (on the
    CPU one per kernel thread, see ``cpu.matmul``).
    """
    xp = np if type(x) is _ndarray else array_module(x)
    x2 = x if x.ndim == 2 else _rows(x)
    y = cpu.product(xp, x2, w, bias=b)
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], w.shape[-1])


def linear_backward_input(dy, w):
    """dx = dy @ w.T"""
    xp = np if type(dy) is _ndarray else array_module(dy)
    dy2 = dy if dy.ndim == 2 else _rows(dy)
    dx = cpu.product(xp, dy2, w.T)
    return dx if dy.ndim == 2 else dx.reshape(*dy.shape[:-1], w.shape[0])


def linear_backward_weight(x, dy, dw, db=None):
    """dw += x.T @ dy, db += sum(dy) over all leading axes (accumulating, for micro-batches)."""
    xp = np if type(dw) is _ndarray else array_module(dw)
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    dy2 = dy if dy.ndim == 2 else dy.reshape(-1, dy.shape[-1])
    cpu.matmul(xp, x2.T, dy2, dw, accumulate=True)
    if db is not None:
        column_sums(dy2, db)


def column_sums(a, out, b=None, out_ab=None):
    """out += sum over the rows of ``a``, and, given ``b`` and ``out_ab``, out_ab += sum over
    the rows of ``a * b`` (a LayerNorm's two weight gradients); 2-D arrays (rows, n).

    One thread: a vector-matrix product (ones @ a, 2-4x faster than ``sum(axis=0)``) and an
    ``einsum`` that never forms a * b. These are a fraction of a millisecond, less than what
    handing them to the kernel threads costs (BENCHMARKS.md)."""
    xp = np if type(a) is _ndarray else array_module(a)
    out += _ones(xp, a.shape[0], a.dtype) @ a
    if b is not None:
        out_ab += xp.einsum("ij,ij->j", a, b)


_ONES: dict = {}  # (array module, length, dtype) -> a read-only vector of ones


def _ones(xp, n, dtype):
    """A vector of ``n`` ones, made once per (module, length, dtype) and never written: a
    column sum per linear and micro-batch need not allocate one each time."""
    key = (xp, n, dtype)
    v = _ONES.get(key)
    if v is None:
        v = _ONES[key] = xp.ones(n, dtype=dtype)
    return v


def add(a, b, out):
    """out = a + b (``b`` may broadcast over the rows of ``a``, or be ``out`` itself for a
    residual's in-place sum), the rows shared among the kernel threads."""
    xp = np if type(a) is _ndarray else array_module(a)
    if xp is not np or a.size < cpu.PARALLEL_MIN_ELEMENTS:
        return xp.add(a, b, out=out)
    a2, b2, o2 = _rows(a), (_rows(b) if b.shape == a.shape else b), _rows(out)
    full = b2.ndim == 2 and b2.shape == a2.shape
    cpu.run_blocks(cpu.row_blocks(xp, *a2.shape),
                   lambda r: xp.add(a2[r], b2[r] if full else b2, out=o2[r]))
    return out


# ----- activations ----------------------------------------------------------------------------

def gelu_forward(x):
    """GELU, tanh approximation. Returns (y, t) where t = tanh(...) is kept for the backward."""
    xp = np if type(x) is _ndarray else array_module(x)
    x2 = _rows(x)
    y, t = cpu.empty(xp, x2.shape, x2.dtype), cpu.empty(xp, x2.shape, x2.dtype)

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

    cpu.run_blocks(cpu.row_blocks(xp, *x2.shape), block)
    return y.reshape(x.shape), t.reshape(x.shape)


def gelu_backward(dy, x, t):
    """d/dx of 0.5 x (1 + tanh(c (x + a x^3))) = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2).

    Per block: s = 0.5 c x (1 + 3 a x^2) (t^2 - 1), then g = (0.5 t + 0.5 - s) * dy.
    """
    xp = np if type(x) is _ndarray else array_module(x)
    x2, t2, dy2 = _rows(x), _rows(t), _rows(dy)
    g = cpu.empty(xp, x2.shape, x2.dtype)

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

    cpu.run_blocks(cpu.row_blocks(xp, *x2.shape), block)
    return g.reshape(x.shape)


def relu_forward(x):
    xp = np if type(x) is _ndarray else array_module(x)
    return xp.maximum(x, 0.0)


def relu_backward(dy, x):
    """``x``: the ReLU's input or its output (their positives are the same)."""
    return dy * (x > 0)


# ----- layer norm -----------------------------------------------------------------------------

def row_dot(a, b):
    """Sum over the last axis of a * b (``b`` may be one vector for every row), without the
    product array. NumPy 2's ``vecdot`` is one pass, 3x faster than ``sum(axis=-1)`` on rows
    of a few hundred (which pays a loop call per row) and, unlike a BLAS matrix-vector product,
    gives each row the same bits whatever rows it comes with (so blocks and threads change
    nothing)."""
    xp = np if type(a) is _ndarray else array_module(a)
    if xp is np and hasattr(np, "vecdot"):
        return np.vecdot(a, b)
    return (a * b).sum(axis=-1)


def layernorm_forward(x, gamma, beta, eps=1e-5):
    """Normalise over the last axis. Returns (y, xhat, rstd)."""
    xp = np if type(x) is _ndarray else array_module(x)
    x2 = _rows(x)
    d = x2.shape[-1]
    y, xhat = cpu.empty(xp, x2.shape, x2.dtype), cpu.empty(xp, x2.shape, x2.dtype)
    rstd = xp.empty((x2.shape[0], 1), dtype=x2.dtype)
    ones = _ones(xp, d, x2.dtype)

    def block(r):
        xb, hb, yb, rb = x2[r], xhat[r], y[r], rstd[r]
        mean = row_dot(xb, ones)
        mean *= 1.0 / d
        xp.subtract(xb, mean[:, None], out=hb)
        var = row_dot(hb, hb)  # two passes (centre, then square): no cancellation
        var *= 1.0 / d
        var += eps
        xp.sqrt(var, out=var)
        xp.reciprocal(var, out=rb[:, 0])
        hb *= rb
        xp.multiply(hb, gamma, out=yb)
        yb += beta

    cpu.run_blocks(cpu.row_blocks(xp, *x2.shape), block)
    return y.reshape(x.shape), xhat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def layernorm_backward_input(dy, xhat, rstd, gamma):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma."""
    xp = np if type(dy) is _ndarray else array_module(dy)
    dy2, h2, r2 = _rows(dy), _rows(xhat), rstd.reshape(-1, 1)
    d = dy2.shape[-1]
    g = cpu.empty(xp, dy2.shape, dy2.dtype)
    ones = _ones(xp, d, dy2.dtype)

    def block(r):
        gb, hb = g[r], h2[r]
        xp.multiply(dy2[r], gamma, out=gb)
        m1 = row_dot(gb, ones)
        m1 *= 1.0 / d
        m2 = row_dot(gb, hb)
        m2 *= 1.0 / d
        gh = cpu.empty(xp, gb.shape, gb.dtype)
        xp.multiply(hb, m2[:, None], out=gh)
        gb -= gh
        gb -= m1[:, None]
        gb *= r2[r]

    cpu.run_blocks(cpu.row_blocks(xp, *dy2.shape), block)
    return g.reshape(dy.shape)


def layernorm_backward_weight(dy, xhat, dgamma, dbeta):
    h = dy.shape[-1]
    dy2, h2 = dy.reshape(-1, h), xhat.reshape(-1, h)
    column_sums(dy2, dbeta, h2, dgamma)


# ----- embedding ------------------------------------------------------------------------------

def embedding_forward(ids, table):
    return table[ids]


def embedding_backward_weight(ids, dy, dtable):
    """dtable[ids] += dy, with repeated ids summed.

    On the CPU the rows of dy are sorted by id (a stable sort: each id's rows keep their order,
    so the sums do not depend on the threads) and each id's run summed with ``add.reduceat``,
    columns shared among the kernel threads: 4x faster than ``add.at``, which takes one
    row at a time on one thread."""
    xp = np if type(dtable) is _ndarray else array_module(dtable)
    ids, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    if xp is not np or ids.size == 0:
        xp.add.at(dtable, ids, dy2)
        return
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    rows = sorted_ids[starts]  # each id once
    grouped = dy2[order]

    def share(c):
        dtable[rows, c] += np.add.reduceat(grouped[:, c], starts, axis=0)

    parts = cpu.kernel_threads() if dy2.size >= cpu.PARALLEL_MIN_ELEMENTS else 1
    cpu.run_blocks(cpu.split(dy2.shape[1], parts), share)


# ----- attention ------------------------------------------------------------------------------

def softmax_lastaxis_(s):
    """Numerically stable softmax over the last axis, in place."""
    xp = np if type(s) is _ndarray else array_module(s)
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    r = row_dot(s, _ones(xp, s.shape[-1], s.dtype))
    xp.reciprocal(r, out=r)  # one division per row, then a multiply per element
    s *= r[..., None]
    return s


def causal_mask(xp, s_q, s_k):
    """True where the query may NOT attend (key position after query position)."""
    return xp.triu(xp.ones((s_q, s_k), dtype=bool), k=1 + s_k - s_q)


def _masked_value(dtype):
    return -1e30 if dtype.itemsize >= 8 else -3e38  # large finite: exp gives exact 0


QUERY_TILE = 64  # query rows per causal tile (fixed, so results do not depend on the blocks)


def _causal_tiles(xp, mask, s_q, s_k):
    """How to skip the masked upper triangle: (query tiles, key tiles).

    Query tile (q0, q1, m0, ke): rows q0:q1 see keys 0:ke only (their scores beyond ke are masked,
    so their probabilities are exactly 0 and are written as 0 without computing them), and the
    mask has no True before column m0 (only the tile's diagonal block needs masking). Key tile
    (k0, k1, qs): keys k0:k1 are seen by queries qs: only. With n tiles this computes
    (1 + 1/n) / 2 of the S x S scores: 75 % at S = 128, 62 % at S = 256. Smaller tiles skip more
    but lose it again in calls and in short products: at two threads, forward + backward of one
    layer took 9.8 / 8.7 / 9.1 ms with tiles of 32 / 64 / 128 at S = 128 (batch 16, 8 heads of
    32), 23.1 / 21.7 / 22.6 ms at S = 256 and 44.8 / 42.7 / 42.8 ms at S = 512 (heads of 64).
    Only for the standard causal mask (any other mask, and the GPU, get one tile: the full
    product)."""
    off = s_k - s_q
    t = QUERY_TILE
    if (xp is not np or mask.ndim != 2 or tuple(mask.shape) != (s_q, s_k) or off < 0
            or s_q <= t or not np.array_equal(mask, causal_mask(np, s_q, s_k))):
        return [(0, s_q, 0, s_k)], [(0, s_k, 0)]
    qt = [(q0, min(q0 + t, s_q), q0 + off, min(q0 + t, s_q) + off) for q0 in range(0, s_q, t)]
    kt = [(k0, min(k0 + t, s_k), max(0, k0 - off)) for k0 in range(0, s_k, t)]
    return qt, kt


def attention_forward(q, k, v, mask, out=None):
    """Causal attention on (B, H, S, D) tensors. Returns (out, probs).

    The 1/sqrt(D) scale goes on q (S*D elements) rather than on the scores (S*S). ``out``, if
    given, is a (B, H, S, D) view to write the result into (say, a transposed view of the
    (B, S, H*D) array the next layer takes), which saves a copy. With the standard causal mask
    the CPU computes only the query tiles' visible keys (``_causal_tiles``); probs is complete
    all the same (zeros above the diagonal).
    """
    xp = np if type(q) is _ndarray else array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = q.shape[-2], k.shape[-2]
    p = cpu.empty(xp, (*q.shape[:-1], s_k), q.dtype)
    if out is None:
        out = xp.empty(q.shape, dtype=q.dtype)
    fill = _masked_value(p.dtype)
    qtiles, _ = _causal_tiles(xp, mask, s_q, s_k)

    def block(ix):
        qb, kb, vb, pb, ob = q[ix] * scale, k[ix], v[ix], p[ix], out[ix]
        for q0, q1, m0, ke in qtiles:
            pt = pb[..., q0:q1, :ke]
            xp.matmul(qb[..., q0:q1, :], kb[..., :ke, :].swapaxes(-1, -2), out=pt)
            # copyto with a broadcast mask: ~20x faster in NumPy than pt[..., mask] = value
            xp.copyto(pt[..., m0:], fill, where=mask[q0:q1, m0:ke])
            softmax_lastaxis_(pt)
            xp.matmul(pt, vb[..., :ke, :], out=ob[..., q0:q1, :])
            if ke < s_k:
                pb[..., q0:q1, ke:].fill(0.0)

    cpu.run_blocks(cpu.head_blocks(xp, q.shape[:-2], (qtiles[0][1] - qtiles[0][0]) * s_k), block)
    return out, p


def attention_backward(dout, q, k, v, p, out=None, dq=None, dk=None, dv=None, mask=None):
    """Gradients of q, k, v for attention_forward.

    ``out`` (the forward's result, if still at hand) makes the softmax backward's row term
    sum_j dp_ij p_ij = dout_i . out_i an S*D product instead of an S*S one (FlashAttention's D
    term). ``dq``, ``dk``, ``dv``, if given, are (B, H, S, D) views the gradients are written into.
    ``mask``, if given, is the forward's mask: with the standard causal one the CPU skips the
    upper triangle as the forward does (probs are exactly 0 there, so the result is the same).
    """
    xp = np if type(dout) is _ndarray else array_module(dout)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = p.shape[-2], p.shape[-1]
    dq = xp.empty(q.shape, dtype=q.dtype) if dq is None else dq
    dk = xp.empty(k.shape, dtype=k.dtype) if dk is None else dk
    dv = xp.empty(v.shape, dtype=v.dtype) if dv is None else dv
    if mask is None:
        qtiles, ktiles = [(0, s_q, 0, s_k)], [(0, s_k, 0)]
    else:
        qtiles, ktiles = _causal_tiles(xp, mask, s_q, s_k)

    def block(ix):
        # the 1/sqrt(D) of dq = scale ds k and dk = scale ds^T q goes on (contiguous copies of)
        # k and q, S*D elements each, instead of on dq and dk, strided views into the caller's
        # fused gradient (a slow pass each)
        pb, db, vb = p[ix], dout[ix], v[ix]
        qb, kb = q[ix] * scale, k[ix] * scale
        dqb, dkb, dvb = dq[ix], dk[ix], dv[ix]
        ds = cpu.empty(xp, pb.shape, pb.dtype)
        rows = None if out is None else row_dot(db, out[ix])[..., None]
        # per query tile: dp = dout v^T, ds = p * (dp - sum_j(dp * p)), dq = ds k
        for q0, q1, _, ke in qtiles:
            pt, dt = pb[..., q0:q1, :ke], ds[..., q0:q1, :ke]
            xp.matmul(db[..., q0:q1, :], vb[..., :ke, :].swapaxes(-1, -2), out=dt)
            if rows is not None:
                dt -= rows[..., q0:q1, :]
            else:
                dt -= row_dot(dt, pt)[..., None]
            dt *= pt
            xp.matmul(dt, kb[..., :ke, :], out=dqb[..., q0:q1, :])
            if ke < s_k and (s_k - s_q) % QUERY_TILE:
                # read by the key tiles below only when keys and queries are not aligned
                ds[..., q0:q1, ke:].fill(0.0)
        # per key tile: dv = p^T dout, dk = ds^T q over the queries that see those keys
        for k0, k1, qs in ktiles:
            xp.matmul(pb[..., qs:, k0:k1].swapaxes(-1, -2), db[..., qs:, :], out=dvb[..., k0:k1, :])
            xp.matmul(ds[..., qs:, k0:k1].swapaxes(-1, -2), qb[..., qs:, :], out=dkb[..., k0:k1, :])

    cpu.run_blocks(cpu.head_blocks(xp, p.shape[:-2], (qtiles[0][1] - qtiles[0][0]) * s_k), block)
    return dq, dk, dv
