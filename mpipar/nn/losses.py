"""Losses: the math of mean squared error and softmax cross-entropy, forward and backward.

Pure math on an array module, like the rest of ``nn/``. A loss object keeps, per micro-batch
``mb``, what its backward needs (``forward`` saves it, ``backward`` consumes it, ``discard``
drops it when a pass is abandoned or recomputed), so a pipeline can hold many micro-batches.

Cross-entropy is written for logits whose last axis is the slice ``[lo, lo + V_local)`` of the
vocabulary, with a ``reduce(x, op)`` that combines per-row partial values over the slices. One
rank holds the whole vocabulary (``lo = 0``, ``reduce`` the identity); the vocab-parallel loss
(``parallel.tensor.VocabParallelCrossEntropy``) passes its rank's offset and an all-reduce over
tp. Both run the same operations in the same order.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module


def _local(x, op):
    """The reduction over vocabulary slices when one rank holds them all: nothing to combine."""
    return x


# ----- mean squared error ---------------------------------------------------------------------

def mse_forward(y, target):
    """Mean squared error over all elements. Returns (loss, diff), diff kept for the backward."""
    diff = y - target
    return float((diff * diff).mean()), diff


def mse_backward(diff, scale=1.0):
    """d(scale * mean (y - target)^2)/dy."""
    return diff * (2.0 * scale / diff.size)


# ----- softmax cross-entropy ------------------------------------------------------------------

def cross_entropy_forward(logits, targets, lo=0, reduce=_local):
    """Mean softmax cross-entropy over the rows of ``logits`` (..., V_local) against integer
    ``targets`` (...), the logits being columns ``[lo, lo + V_local)`` of the vocabulary.

    Never forms the full row: the row max, the target logit and the sum of exponentials are each
    combined with ``reduce`` (Megatron's vocab-parallel loss: a few scalars per token). Returns
    (loss, ctx): ``ctx`` holds this slice of the softmax (computed in place in a new array) and
    what ``cross_entropy_backward`` needs.
    """
    xp = array_module(logits)
    v_local = logits.shape[-1]
    z = logits.reshape(-1, v_local)
    t = xp.asarray(targets).reshape(-1)
    n = z.shape[0]
    rowmax = reduce(z.max(axis=1), "max")
    e = z - rowmax[:, None]
    if reduce is _local and lo == 0 and n and 0 <= t.min() and t.max() < v_local:
        # the whole vocabulary here and every target in it: no mask (a product by True and
        # a sum over one slice change no bit), a few array operations fewer per micro-batch
        inside, local_t = None, t
        picked = e[xp.arange(n), t]
    else:
        inside = (t >= lo) & (t < lo + v_local)
        local_t = xp.where(inside, t - lo, 0)
        picked = e[xp.arange(n), local_t] * inside
        picked = reduce(picked, "sum")
    xp.exp(e, out=e)
    sumexp = reduce(e.sum(axis=1), "sum")
    loss = float((xp.log(sumexp) - picked).mean())
    e /= sumexp[:, None]  # e is now this slice of the softmax
    return loss, (e, local_t, inside, logits.shape)


_ARANGE: dict = {}  # n -> a read-only np.arange(n): the row index of every pick


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rows(n):
    r = _ARANGE.get(n)
    if r is None:
        if len(_ARANGE) > 64:  # micro-batch sizes come and go (evaluation, resumes)
            _ARANGE.clear()
        r = _ARANGE[n] = np.arange(n)
        r.flags.writeable = False
    return r


def cross_entropy_whole(logits, targets):
    """``cross_entropy_forward`` for NumPy logits holding the whole vocabulary, when every
    target lies in it; None otherwise (the caller then takes the general function). The same
    operations on the same values, so the same bits (tests/test_dense_fast_path.py), in fewer
    calls: a small model computes its loss per micro-batch, on a few rows of a few classes,
    where each NumPy call's fixed cost is most of the time. The row max keeps its axis (no
    ``[:, None]`` view), the row index is made once per row count, no array-module look-ups."""
    v = logits.shape[-1]
    z = logits if logits.ndim == 2 else logits.reshape(-1, v)
    t = targets if type(targets) is np.ndarray else np.asarray(targets)
    if t.ndim != 1:
        t = t.reshape(-1)
    n = z.shape[0]
    kind = t.dtype.kind
    if not n or t.shape[0] != n or kind not in "iu":
        return None
    # one reduction for both ends: a negative signed target read as unsigned is above any v
    if _maximum_reduce(t.view(_UNSIGNED[t.dtype.itemsize]) if kind == "i" else t) >= v:
        return None
    # the reductions as the ufuncs' own ``reduce`` (what ``max``, ``sum`` and ``mean`` call,
    # without their Python wrappers): the same kernels, so the same bits
    e = z - _maximum_reduce(z, 1, None, None, True)
    rows = _rows(n)
    picked = e[rows, t]
    np.exp(e, out=e)
    sumexp = _add_reduce(e, 1)
    loss = _mean(np.log(sumexp) - picked, n)
    e /= sumexp.reshape(n, 1)  # e is now the softmax
    return loss, (e, t, None, logits.shape)


_maximum_reduce, _add_reduce = np.maximum.reduce, np.add.reduce


def _mean(v, n) -> float:
    """``float(v.mean())`` of a 1-D array of ``n`` floats, as NumPy computes it (the sum, then
    the quotient by the count cast back to the sum's type), without ``mean``'s Python layer."""
    s = _add_reduce(v)
    return float(s.dtype.type(s / np.intp(n)))


def cross_entropy_backward(ctx, scale=1.0):
    """d(scale * mean CE)/dlogits = scale * (p - onehot) / N, in place in the saved softmax."""
    p, local_t, inside, shape = ctx
    n = p.shape[0]
    if inside is None and type(p) is np.ndarray:  # the whole vocabulary, on NumPy
        p[_rows(n), local_t] -= 1
    else:
        xp = array_module(p)
        p[xp.arange(n), local_t] -= 1 if inside is None else inside.astype(p.dtype)
    p *= scale / n
    return p if p.shape == shape else p.reshape(shape)


# ----- loss objects ---------------------------------------------------------------------------

class Loss:
    """``forward(y, target, mb, scale)`` -> the micro-batch's mean loss (unscaled), keeping what
    ``backward(mb)`` needs; ``scale`` multiplies the gradient (1 / micro-batches for a batch
    mean). ``discard(mb)`` forgets a micro-batch's saved context (no-op if none is held)."""

    def __init__(self):
        self._ctx: dict = {}

    def discard(self, mb) -> None:
        self._ctx.pop(mb, None)

    def in_flight(self) -> set:
        """Micro-batches whose context is still held."""
        return set(self._ctx)


class MSELoss(Loss):
    """Mean squared error over all output elements (regression MLP; outputs replicated over tp)."""

    def forward(self, y, target, mb=0, scale=1.0) -> float:
        loss, diff = mse_forward(y, target)
        self._ctx[mb] = (diff, scale)
        return loss

    def backward(self, mb=0):
        diff, scale = self._ctx.pop(mb)
        return mse_backward(diff, scale)


class CrossEntropyLoss(Loss):
    """Mean softmax cross-entropy over all tokens (rows), logits holding the whole vocabulary.

    Subclasses covering a slice of the vocabulary override ``_offset`` and ``_reduce``.
    """

    def _offset(self, v_local: int) -> int:
        return 0

    def _reduce(self, x, op):
        return x

    def forward(self, logits, targets, mb=0, scale=1.0) -> float:
        whole = type(self) is CrossEntropyLoss
        out = cross_entropy_whole(logits, targets) if whole and type(logits) is np.ndarray \
            else None
        if out is None:  # a vocabulary slice (tp), CuPy, or a target outside the vocabulary
            out = cross_entropy_forward(logits, targets, self._offset(logits.shape[-1]),
                                        _local if whole else self._reduce)
        self._ctx[mb] = (out[1], scale)
        return out[0]

    def backward(self, mb=0):
        ctx, scale = self._ctx.pop(mb)
        return cross_entropy_backward(ctx, scale)
