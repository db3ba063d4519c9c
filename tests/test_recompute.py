"""Selective recomputation: the attention core drops its probabilities and rebuilds them in the
backward; gradients stay bitwise those of keeping them (float64 and float32)."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.config import ConfigError, load_config
from mpipar.models import build_model
from mpipar.nn.layers import CausalSelfAttention, set_selective_recompute


def _grads(selective, dtype):
    cfg = load_config(None, {"model.n_layer": 2, "model.n_embd": 16, "model.n_head": 4,
                             "model.block_size": 8, "model.vocab_size": 32, "train.seq_len": 8,
                             "train.dtype": dtype})
    model = build_model(cfg.model, Backend("cpu", dtype), seed=3)
    assert set_selective_recompute(model.units, selective) == 2
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32, (2, 8))
    x = ids
    for u in model.units:
        x = u.forward(x, 0)
    cores = [l for u in model.units for l in _walk(u) if isinstance(l, CausalSelfAttention)]
    held = [c._ctx[0][3] for c in cores]
    assert all((p is None) == selective for p in held)
    model.loss.forward(x, rng.integers(0, 32, (2, 8)), 0)
    dy = model.loss.backward(0)
    for u in reversed(model.units):
        dy = u.backward(dy, 0)
    return [p.grad.copy() for p in model.params()]


def _walk(layer):
    yield layer
    for c in layer.children():
        yield from _walk(c)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_selective_gradients_are_bitwise_equal(dtype):
    full, selective = _grads(False, dtype), _grads(True, dtype)
    assert len(full) == len(selective)
    for a, b in zip(full, selective, strict=True):
        assert np.array_equal(a, b)


def test_recompute_values():
    assert load_config(None, {"parallel.recompute": "selective"}).parallel.recompute == "selective"
    assert load_config(None, {"parallel.recompute": "full"}).parallel.recompute is True
    assert load_config(None, {"parallel.recompute": "none"}).parallel.recompute is False
    with pytest.raises(ConfigError, match="parallel.recompute must be none, full or selective"):
        load_config(None, {"parallel.recompute": "some"})
