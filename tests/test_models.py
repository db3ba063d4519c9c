"""Whole-model gradients (float64) against finite differences; the split backward; micro-batches."""

import numpy as np
import pytest
from gradcheck import numeric_grad, rel_err

from mpipar.backend import Backend
from mpipar.config import ModelConfig
from mpipar.models import build_model

BK = Backend("cpu", "float64")


def gpt_cfg(**kw):
    base = dict(kind="gpt", vocab_size=13, block_size=8, n_layer=2, n_embd=8, n_head=2,
                init_std=0.3)
    base.update(kw)
    return ModelConfig(**base)


def randomize(model, seed=0):
    """Random (never zero) values for every parameter, biases and LayerNorm included."""
    rng = np.random.default_rng(seed)
    for p in model.params():
        p.load_full(rng.normal(0, 0.5, size=p.full_shape) + (p.init == "ones"))


def loss_and_grads(model, x, y, mb=0, scale=1.0, split=False):
    h = x
    for u in model.units:
        h = u.forward(h, mb)
    loss = model.loss.forward(h, y, mb, scale)
    d = model.loss.backward(mb)
    for u in reversed(model.units):
        if split:
            d = u.backward_input(d, mb)
        else:
            d = u.backward(d, mb)
    if split:
        for u in model.units:
            u.backward_weight(mb)
    return loss


def forward_loss(model, x, y):
    h = x
    for u in model.units:
        h = u.forward(h, "probe")
    loss = model.loss.forward(h, y, "probe")
    for u in model.units:
        u.drop("probe")
    model.loss.discard("probe")
    return loss


def data_for(model_cfg, rng, b=3, s=6):
    if model_cfg.kind == "gpt":
        x = rng.integers(0, model_cfg.vocab_size, size=(b, s))
        y = rng.integers(0, model_cfg.vocab_size, size=(b, s))
        return x, y
    x = rng.normal(size=(b, model_cfg.sizes[0]))
    if model_cfg.task == "classification":
        return x, rng.integers(0, model_cfg.sizes[-1], size=b)
    return x, rng.normal(size=(b, model_cfg.sizes[-1]))


CASES = [
    gpt_cfg(),
    gpt_cfg(tie_embeddings=True),
    ModelConfig(kind="mlp", sizes=[5, 7, 6, 4], activation="gelu", task="classification",
                init_std=0.5),
    ModelConfig(kind="mlp", sizes=[5, 7, 3], activation="relu", task="regression",
                init_std=0.5),
]


@pytest.mark.parametrize("mcfg", CASES, ids=["gpt", "gpt-tied", "mlp-cls", "mlp-reg"])
def test_every_parameter_against_finite_differences(mcfg):
    rng = np.random.default_rng(7)
    model = build_model(mcfg, BK, seed=3)
    randomize(model, 11)
    x, y = data_for(mcfg, rng)
    loss_and_grads(model, x, y)
    for p in model.params():
        idx, num = numeric_grad(lambda: forward_loss(model, x, y), p.data, n_samples=12, rng=rng)
        ana = p.grad.reshape(-1)[idx]
        assert rel_err(ana, num) <= 1e-6, p.name
    assert all(not u.in_flight() for u in model.units)


def test_split_backward_equals_backward_and_microbatches_in_flight():
    mcfg = gpt_cfg()
    rng = np.random.default_rng(0)
    x, y = data_for(mcfg, rng, b=4)
    ref = build_model(mcfg, BK, seed=1)
    randomize(ref)
    loss_and_grads(ref, x, y)
    split = build_model(mcfg, BK, seed=1)
    randomize(split)
    loss_and_grads(split, x, y, split=True)
    for a, b in zip(ref.params(), split.params()):
        assert np.array_equal(a.grad, b.grad), a.name
    # two micro-batches in flight at once (both forwards, then both backwards, W delayed)
    inflight = build_model(mcfg, BK, seed=1)
    randomize(inflight)
    acts = {}
    for mb in (0, 1):
        h = x[2 * mb:2 * mb + 2]
        for u in inflight.units:
            h = u.forward(h, mb)
        inflight.loss.forward(h, y[2 * mb:2 * mb + 2], mb, scale=0.5)
        acts[mb] = inflight.loss.backward(mb)
    for mb in (1, 0):
        d = acts[mb]
        for u in reversed(inflight.units):
            d = u.backward_input(d, mb)
    for mb in (0, 1):
        for u in inflight.units:
            u.backward_weight(mb)
    for a, b in zip(ref.params(), inflight.params()):
        assert rel_err(a.grad, b.grad) < 1e-12, a.name


def test_float32_model_stays_float32():
    mcfg = gpt_cfg()
    model = build_model(mcfg, Backend("cpu", "float32"), seed=0)
    x, y = data_for(mcfg, np.random.default_rng(0))
    h = x
    for u in model.units:
        h = u.forward(h, 0)
        assert h.dtype == np.float32
    model.loss.forward(h, y, 0)
    d = model.loss.backward(0)
    for u in reversed(model.units):
        d = u.backward(d, 0)
        assert d is None or d.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.params())


def test_same_seed_same_weights_names_unique():
    a = build_model(gpt_cfg(), BK, seed=5)
    b = build_model(gpt_cfg(), BK, seed=5)
    names = [p.name for p in a.params()]
    assert len(names) == len(set(names))
    for p, q in zip(a.params(), b.params()):
        assert np.array_equal(p.data, q.data)


def _decay_by_name(model):
    from mpipar.nn.optim import decays

    return {p.name: decays(p) for p in model.params()}


def test_gpt_weight_decay_by_role():
    """Biases (the fused qkv bias, stored (3, d), included) and every LayerNorm gain and bias are
    never decayed; every other tensor (linear weights, token and position tables) is."""
    model = build_model(gpt_cfg(tie_embeddings=False), BK)
    by_name = {p.name: p for p in model.params()}
    assert by_name["blocks.0.attn.qkv.bias"].full_shape == (3, 8)  # 2-D, yet a bias
    decay = _decay_by_name(model)
    kept = [n for n in decay if n.endswith(".bias") or ".ln" in n or n.startswith("ln_f.")]
    assert {"blocks.0.attn.qkv.bias", "ln_f.weight", "blocks.1.ln2.bias"} <= set(kept)
    assert not any(decay[n] for n in kept)
    others = sorted(set(decay) - set(kept))
    assert others and all(decay[n] for n in others)
    assert "head.weight" in others
    assert {"embed.tok.weight", "embed.pos.weight", "blocks.0.attn.qkv.weight"} <= set(others)


def test_mlp_weight_decay_by_role():
    model = build_model(ModelConfig(kind="mlp", sizes=[4, 6, 6, 3]), BK)
    decay = _decay_by_name(model)
    assert decay and all(decay[n] == n.endswith(".weight") for n in decay)
    assert any(n.endswith(".bias") for n in decay)
