"""The model's first chunk computes no input gradient (its input is data, the gradient would be
thrown away), and what it does compute is what the full backward computes, bit for bit; a new
product's output is the same whether it comes from the pool or from ``matmul`` itself."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn import cpu
from mpipar.nn.layers import Linear, ParamFactory, ReLU, Sequential


def _units(seed=0):
    pf = ParamFactory(Backend("cpu", "float64"), seed=seed, std=0.3)
    return [Sequential([Linear(pf, f"l{i}", 5, 5), ReLU(f"a{i}")], name=f"u{i}")
            for i in range(3)]


def _grads(units):
    return [p.grad.copy() for u in units for p in u.params()]


def test_backward_no_dx_gives_the_same_weight_gradients_and_skips_the_first_product():
    x = np.random.default_rng(1).standard_normal((4, 5))
    dy = np.random.default_rng(2).standard_normal((4, 5))
    full, lean = _units(), _units()
    for units, first_pass in ((full, "backward_input"), (lean, "backward_no_dx")):
        chunk = Sequential(units)
        for mb in range(2):  # two micro-batches: the accumulation is the same too
            chunk.forward(x + mb, mb)
            getattr(chunk, first_pass)(dy * (mb + 1), mb)
            chunk.backward_weight(mb)
        assert not chunk.in_flight()
    for a, b in zip(_grads(full), _grads(lean), strict=True):
        assert np.array_equal(a, b)
    first = lean[0].layers[0]
    first.forward(x, 0)

    def no_product(*_):
        raise AssertionError("the first linear computed its input gradient")

    first.backward_input = no_product  # backward_no_dx must not call it
    first.backward_no_dx(dy, 0)
    first.backward_weight(0)


def test_executor_skips_the_input_gradient_of_chunk_zero_only(monkeypatch):
    from mpipar.parallel.pipeline import executor as ex

    calls = []
    monkeypatch.setattr(ex.Chunk, "backward_input",
                        lambda self, dy, mb=0: calls.append(self.index) or dy)
    monkeypatch.setattr(ex.Chunk, "backward_no_dx",
                        lambda self, dy, mb=0: calls.append(("no dx", self.index)))
    run = ex.PipelineExecutor.__new__(ex.PipelineExecutor)
    run.on_unit_ready, run.asynchronous = None, False
    for c in (0, 1):
        run._backward_pass("B", None, ex.Chunk(c, [], c), np.zeros(2), 0)
    assert calls == [("no dx", 0), 1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(32, 127, 126), (3, 784, 128)])
def test_a_new_product_has_the_pooled_products_bits(dtype, shape):
    m, k, n = shape
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((n, k)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    for bb in (b.T, np.ascontiguousarray(b.T)):  # a transposed view (dx = dy @ w.T) and not
        want = cpu.matmul(np, a, bb, cpu.empty(np, (m, n), dtype), bias=bias)
        got = cpu.product(np, a, bb, bias=bias)
        assert got.dtype == dtype and np.array_equal(got, want)
