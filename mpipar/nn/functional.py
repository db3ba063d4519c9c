"""Hand-written kernels: forward and backward of every operation, on any array module.

Pure functions of arrays. The array module comes from the arrays themselves (``array_module``), so
the same code runs with NumPy and CuPy. Scalars are Python floats so that NumPy 2's promotion
rules keep float32 arrays float32 (``float32_array * np.float64(x)`` would become float64).
Element-wise work is done in place where it is safe: the allocations and passes around the
matrix products are what make hand-written NumPy slow, not the products themselves.
"""

from __future__ import annotations

import math

from ..backend import array_module

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


# ----- linear ---------------------------------------------------------------------------------

def linear_forward(x, w, b=None):
    """y = x @ w (+ b); x (..., in), w (in, out), b (out,)."""
    y = x @ w
    if b is not None:
        y += b
    return y


def linear_backward_input(dy, w):
    """dx = dy @ w.T"""
    return dy @ w.T


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
    inner = x * x  # x*x*x instead of x**3: integer powers are ~100x slower in NumPy
    inner *= GELU_A
    inner += 1.0
    inner *= x
    inner *= GELU_C
    t = xp.tanh(inner, out=inner)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, t


def gelu_backward(dy, x, t):
    """d/dx of 0.5 x (1 + tanh(c (x + a x^3))) = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)."""
    # g = 0.5*(1+t) + 0.5*x*(1-t*t)*c*(1+3a x^2), built in two buffers
    s = x * x
    s *= 3.0 * GELU_A
    s += 1.0
    s *= x
    s *= 0.5 * GELU_C
    u = t * t
    u -= 1.0
    s *= u  # = -0.5 c x (1+3a x^2)(1 - t^2)
    g = t + 1.0
    g *= 0.5
    g -= s
    g *= dy
    return g


def relu_forward(x):
    xp = array_module(x)
    return xp.maximum(x, 0.0)


def relu_backward(dy, x):
    return dy * (x > 0)


# ----- layer norm -----------------------------------------------------------------------------

def layernorm_forward(x, gamma, beta, eps=1e-5):
    """Normalise over the last axis. Returns (y, xhat, rstd)."""
    xp = array_module(x)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat = xc
    xhat *= rstd
    y = xhat * gamma
    y += beta
    return y, xhat, rstd


def layernorm_backward_input(dy, xhat, rstd, gamma):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma."""
    g = dy * gamma
    m1 = g.mean(axis=-1, keepdims=True)
    m2 = (g * xhat).mean(axis=-1, keepdims=True)
    g -= m1
    g -= xhat * m2
    g *= rstd
    return g


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
    s /= s.sum(axis=-1, keepdims=True)
    return s


def causal_mask(xp, s_q, s_k):
    """True where the query may NOT attend (key position after query position)."""
    return xp.triu(xp.ones((s_q, s_k), dtype=bool), k=1 + s_k - s_q)


def attention_forward(q, k, v, mask):
    """Causal attention on (B, H, S, D) tensors. Returns (out, probs)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.swapaxes(-1, -2)
    s *= scale
    s[..., mask] = -1e30 if s.dtype.itemsize >= 8 else -3e38  # large finite: exp gives exact 0
    p = softmax_lastaxis_(s)
    return p @ v, p


def attention_backward(dout, q, k, v, p):
    """Gradients of q, k, v for attention_forward."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = p.swapaxes(-1, -2) @ dout
    dp = dout @ v.swapaxes(-1, -2)
    # softmax backward: ds = p * (dp - sum(dp * p))
    row = (dp * p).sum(axis=-1, keepdims=True)
    dp -= row
    dp *= p
    dp *= scale
    dq = dp @ k
    dk = dp.swapaxes(-1, -2) @ q
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
    """Mean squared error over all elements. Returns (loss, diff) with diff kept for the backward."""
    diff = y - target
    return float((diff * diff).mean()), diff


def mse_backward(diff, scale=1.0):
    return diff * (2.0 * scale / diff.size)
