"""Finite differences (float64, random inputs) for every hand-written kernel."""

import threading

import numpy as np
import pytest
from gradcheck import numeric_grad, rel_err

from mpipar.nn import functional as F
from mpipar.nn import losses as L

RNG = np.random.default_rng(1234)


def check(loss_of, x, analytic, tol=1e-6):
    _, num = numeric_grad(loss_of, x)
    assert rel_err(analytic.reshape(-1), num) <= tol


def test_linear():
    x, w, b = RNG.normal(size=(3, 4, 5)), RNG.normal(size=(5, 6)), RNG.normal(size=6)
    c = RNG.normal(size=(3, 4, 6))

    def loss():
        return float((F.linear_forward(x, w, b) * c).sum())

    check(loss, x, F.linear_backward_input(c, w))
    dw, db = np.zeros_like(w), np.zeros_like(b)
    F.linear_backward_weight(x, c, dw, db)
    check(loss, w, dw)
    check(loss, b, db)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_activations(act):
    x = RNG.normal(size=(4, 7)) * 2
    x[np.abs(x) < 1e-3] = 0.5  # keep ReLU away from its kink
    c = RNG.normal(size=x.shape)
    if act == "gelu":
        def loss():
            return float((F.gelu_forward(x)[0] * c).sum())
        y, t = F.gelu_forward(x)
        ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
        assert rel_err(y, ref) < 1e-14
        check(loss, x, F.gelu_backward(c, x, t))
    else:
        def loss():
            return float((F.relu_forward(x) * c).sum())
        check(loss, x, F.relu_backward(c, x))


def test_layernorm():
    x = RNG.normal(size=(2, 3, 8)) * 3 + 1
    g, b = RNG.normal(size=8), RNG.normal(size=8)
    c = RNG.normal(size=x.shape)

    def loss():
        return float((F.layernorm_forward(x, g, b)[0] * c).sum())

    y, xhat, rstd = F.layernorm_forward(x, g, b)
    check(loss, x, F.layernorm_backward_input(c, xhat, rstd, g))
    dg, db = np.zeros(8), np.zeros(8)
    F.layernorm_backward_weight(c, xhat, dg, db)
    check(loss, g, dg)
    check(loss, b, db)


def test_embedding():
    table = RNG.normal(size=(10, 4))
    ids = RNG.integers(0, 10, size=(3, 5))
    c = RNG.normal(size=(3, 5, 4))

    def loss():
        return float((F.embedding_forward(ids, table) * c).sum())

    d = np.zeros_like(table)
    F.embedding_backward_weight(ids, c, d)
    check(loss, table, d)


def test_attention():
    b, h, s, d = 2, 3, 5, 4
    q, k, v = (RNG.normal(size=(b, h, s, d)) for _ in range(3))
    c = RNG.normal(size=(b, h, s, d))
    mask = F.causal_mask(np, s, s)

    def loss():
        return float((F.attention_forward(q, k, v, mask)[0] * c).sum())

    out, p = F.attention_forward(q, k, v, mask)
    assert np.allclose(np.triu(p[0, 0], 1), 0)
    assert np.allclose(p.sum(-1), 1)
    dq, dk, dv = F.attention_backward(c, q, k, v, p)
    check(loss, q, dq)
    check(loss, k, dk)
    check(loss, v, dv)


def test_cross_entropy_and_stability():
    logits = RNG.normal(size=(6, 9)) * 3
    t = RNG.integers(0, 9, size=6)

    def loss():
        return L.cross_entropy_forward(logits.copy(), t)[0]

    _, ctx = L.cross_entropy_forward(logits.copy(), t)
    check(loss, logits, L.cross_entropy_backward(ctx))
    big = logits + 1e4  # max subtraction keeps it finite
    assert np.isfinite(L.cross_entropy_forward(big, t)[0])


def test_cross_entropy_over_vocabulary_slices_equals_the_whole():
    """Two slices of the vocabulary with a reduce that combines them (what tp does over ranks)
    give the loss and, sliced, the gradient of the whole-vocabulary loss."""
    logits = RNG.normal(size=(2, 3, 8))
    t = RNG.integers(0, 8, size=(2, 3))
    whole, ctx = L.cross_entropy_forward(logits.copy(), t)
    want = L.cross_entropy_backward(ctx, scale=0.5)
    # two "ranks" on two threads, each holding half the vocabulary; reduce exchanges through
    # a barrier, as an all-reduce over tp would
    barrier, box, out = threading.Barrier(2), [None, None], [None, None]

    def rank(i):
        def reduce(x, op):
            box[i] = x
            barrier.wait()
            y = np.maximum(box[0], box[1]) if op == "max" else box[0] + box[1]
            barrier.wait()
            return y

        lo = 4 * i
        loss, c = L.cross_entropy_forward(logits[..., lo:lo + 4].copy(), t, lo, reduce)
        out[i] = (loss, L.cross_entropy_backward(c, scale=0.5))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    for loss, _ in out:
        assert loss == pytest.approx(whole, rel=1e-13)
    got = np.concatenate([g for _, g in out], axis=-1)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("make", [L.MSELoss, L.CrossEntropyLoss])
def test_loss_discard_drops_only_that_micro_batch(make):
    loss = make()
    y = RNG.normal(size=(2, 5))
    target = RNG.integers(0, 5, size=2) if make is L.CrossEntropyLoss else RNG.normal(size=(2, 5))
    loss.forward(y.copy(), target, mb=0)
    loss.forward(y.copy(), target, mb=1)
    loss.discard(0)
    loss.discard("never seen")  # nothing held: a no-op
    assert loss.in_flight() == {1}
    assert loss.backward(1).shape == y.shape
    with pytest.raises(KeyError):
        loss.backward(0)


def test_mse():
    y, target = RNG.normal(size=(4, 3)), RNG.normal(size=(4, 3))

    def loss():
        return L.mse_forward(y, target)[0]

    _, diff = L.mse_forward(y, target)
    check(loss, y, L.mse_backward(diff))


def test_float32_stays_float32():
    x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    w = RNG.normal(size=(8, 8)).astype(np.float32)
    g = np.ones(8, np.float32)
    assert F.linear_forward(x, w).dtype == np.float32
    y, t = F.gelu_forward(x)
    assert y.dtype == np.float32 and F.gelu_backward(x, x, t).dtype == np.float32
    y, xhat, rstd = F.layernorm_forward(x, g, g)
    assert y.dtype == np.float32
    assert F.layernorm_backward_input(x, xhat, rstd, g).dtype == np.float32
    q = x.reshape(2, 1, 3, 8)
    out, p = F.attention_forward(q, q, q, F.causal_mask(np, 3, 3))
    assert out.dtype == np.float32
    assert all(a.dtype == np.float32 for a in F.attention_backward(out, q, q, q, p))
