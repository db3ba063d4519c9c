"""The fixed-cost cuts of a step change no bit: a chunk's backward run layer by layer (each
layer's input and weight gradients together) equals the two sweeps (every input gradient, then
every weight gradient); the whole-vocabulary cross-entropy without the mask equals the masked
one; a data-parallel replica's own rows are the rows it cut from the global batch before."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn import losses
from mpipar.nn.layers import Linear, ParamFactory, ReLU, Sequential


def _chunk(seed=0, d=6):
    pf = ParamFactory(Backend("cpu", "float64"), seed=seed, std=0.4)
    return Sequential([Sequential([Linear(pf, f"l{i}", d, d), ReLU(f"a{i}")], name=f"u{i}")
                       for i in range(3)] + [Linear(pf, "head", d, d)])


def _grads(chunk):
    return [p.grad.copy() for p in chunk.params()]


@pytest.mark.parametrize("first", [False, True])
def test_layer_by_layer_backward_equals_the_two_sweeps(first):
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    sweeps, interleaved = _chunk(), _chunk()
    for mb in range(3):  # micro-batches accumulate into the same gradients
        for c in (sweeps, interleaved):
            c.forward(x * (mb + 1), mb)
        if first:
            sweeps.backward_no_dx(dy - mb, mb)
            sweeps.backward_weight(mb)
            assert interleaved.backward_first(dy - mb, mb) is None
        else:
            dx_a = sweeps.backward_input(dy - mb, mb)
            sweeps.backward_weight(mb)
            dx_b = interleaved.backward(dy - mb, mb)
            assert np.array_equal(dx_a, dx_b)
        assert not sweeps.in_flight() and not interleaved.in_flight()
    for a, b in zip(_grads(sweeps), _grads(interleaved), strict=True):
        assert np.array_equal(a, b)


def test_layer_by_layer_calls_both_passes_in_backward_order():
    order = []

    class Probe(ReLU):
        def backward_input(self, dy, mb=0):
            order.append(("input", self.name))
            return dy

        def backward_weight(self, mb=0):
            order.append(("weight", self.name))

    chunk = Sequential([Sequential([Probe("a"), Probe("b")]), Probe("c")])
    chunk.backward(np.zeros(2), 0)
    assert order == [("input", "c"), ("weight", "c"), ("input", "b"), ("weight", "b"),
                     ("input", "a"), ("weight", "a")]
    order.clear()
    chunk.backward_first(np.zeros(2), 0)  # the first layer: backward_no_dx = its input pass
    assert order[-2:] == [("input", "a"), ("weight", "a")]


def test_a_sequential_with_its_own_input_pass_keeps_its_order():
    order = []

    class Custom(Sequential):
        def backward_input(self, dy, mb=0):
            order.append("custom input")
            return dy

        def backward_weight(self, mb=0):
            order.append("custom weight")

    Sequential([Custom([])]).backward(np.zeros(2), 0)
    assert order == ["custom input", "custom weight"]


def _masked(x, op):
    """An identity reduction that is not ``losses._local``: forces the masked path."""
    return x


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_whole_vocabulary_cross_entropy_equals_the_masked_one(dtype):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((16, 10)).astype(dtype) * 3
    t = rng.integers(0, 10, 16)
    fast = losses.cross_entropy_forward(logits.copy(), t)
    slow = losses.cross_entropy_forward(logits.copy(), t, reduce=_masked)
    assert fast[1][2] is None and slow[1][2] is not None  # each took its own path
    assert fast[0] == slow[0]
    g_fast = losses.cross_entropy_backward(fast[1], 0.25)
    g_slow = losses.cross_entropy_backward(slow[1], 0.25)
    assert g_fast.dtype == g_slow.dtype and np.array_equal(g_fast, g_slow)
    loss = losses.CrossEntropyLoss()
    assert loss.forward(logits.copy(), t, 0, scale=0.25) == fast[0]
    assert np.array_equal(loss.backward(0), g_fast)


def test_a_target_outside_the_vocabulary_takes_the_masked_path():
    logits = np.random.default_rng(5).standard_normal((4, 3))
    t = np.array([0, 2, 3, 1])  # 3 is outside: masked (no gradient), as before
    loss, ctx = losses.cross_entropy_forward(logits.copy(), t)
    ref, ref_ctx = losses.cross_entropy_forward(logits.copy(), t, reduce=_masked)
    assert ctx[2] is not None and loss == ref
    assert np.array_equal(losses.cross_entropy_backward(ctx),
                          losses.cross_entropy_backward(ref_ctx))


def test_a_replica_gathers_exactly_its_rows_of_the_global_batch():
    from mpipar.config import load_config
    from mpipar.training.batches import Batches, split_rows

    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": "[12, 8, 5]",
                             "model.task": "classification", "train.dtype": "float32"})
    b = Batches(cfg)
    for split in ("train", "val"):
        x, y = b.get(split, 7, 24)
        for dp in (2, 3):
            for r in range(dp):
                xr, yr = b.get(split, 7, 24, parts=dp, part=r)
                assert np.array_equal(xr, split_rows(x, dp, r))
                assert np.array_equal(yr, split_rows(y, dp, r))
