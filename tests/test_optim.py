"""Optimisers, clipping and the lr schedule against hand-written float64 references."""

import math

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn.optim import (
    SGD,
    AdamW,
    clip_grads_,
    decays,
    grad_norm_sq_local,
    lr_at,
)
from mpipar.nn.params import Parameter, ShardSpec

F64 = Backend("cpu", "float64")
F32 = Backend("cpu", "float32")


def make_params(backend=F64, seed=0):
    """A matrix (decayed), a bias and a LayerNorm gain (not decayed), random grads."""
    return [
        Parameter("w", (5, 3), backend, role="weight", std=0.5, seed=seed),
        Parameter("b", (3,), backend, role="bias", std=0.5, seed=seed),
        Parameter("ln.g", (4,), backend, role="norm", std=0.5, seed=seed),
    ]


def norm(params) -> float:
    """One rank's gradient norm (what the trainer takes after summing over ranks)."""
    return math.sqrt(grad_norm_sq_local(params))


def set_grads(params, rng):
    for p in params:
        p.grad[...] = rng.normal(size=p.shape)


def snapshot(params):
    return {p.name: p.data.astype(np.float64).copy() for p in params}


# --- references, written from the formulas -------------------------------------------------


def ref_adamw(w, grads, lr, b1, b2, eps, wd):
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        w = w - lr * wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - b1**t)
        vhat = v / (1 - b2**t)
        w = w - lr * mhat / (np.sqrt(vhat) + eps)
    return w


def ref_sgd(w, grads, lr, mom, wd, nesterov):
    buf = None
    for g in grads:
        g = g + wd * w
        if mom:
            buf = g.copy() if buf is None else mom * buf + g
            g = g + mom * buf if nesterov else buf
        w = w - lr * g
    return w


def run_opt(opt, params, n_steps, rng):
    """Apply n_steps with fresh random grads; returns the grads used per parameter."""
    used = {p.name: [] for p in params}
    for _ in range(n_steps):
        set_grads(params, rng)
        for p in params:
            used[p.name].append(p.grad.copy())
        opt.step()
    return used


@pytest.mark.parametrize("n_steps", [1, 5])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_reference(n_steps, wd):
    params = make_params()
    w0 = snapshot(params)
    lr, betas, eps = 0.01, (0.9, 0.95), 1e-8
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    grads = run_opt(opt, params, n_steps, np.random.default_rng(1))
    for p in params:
        decay = wd if p.role == "weight" else 0.0  # biases / LayerNorm not decayed
        want = ref_adamw(w0[p.name], grads[p.name], lr, *betas, eps, decay)
        assert np.allclose(p.data, want, rtol=1e-12, atol=1e-15), p.name
        assert not np.allclose(p.data, w0[p.name])  # it moved
    assert opt.step_count == n_steps


@pytest.mark.parametrize("mom,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_sgd_matches_reference(mom, nesterov, wd):
    params = make_params()
    w0 = snapshot(params)
    opt = SGD(params, lr=0.1, momentum=mom, weight_decay=wd, nesterov=nesterov)
    grads = run_opt(opt, params, 4, np.random.default_rng(2))
    for p in params:
        decay = wd if p.role == "weight" else 0.0
        want = ref_sgd(w0[p.name], grads[p.name], 0.1, mom, decay, nesterov)
        assert np.allclose(p.data, want, rtol=1e-12, atol=1e-15), p.name


def test_step_lr_override_and_grads_untouched():
    params = make_params()
    w0 = snapshot(params)
    set_grads(params, np.random.default_rng(3))
    g0 = {p.name: p.grad.copy() for p in params}
    opt = SGD(params, lr=123.0, weight_decay=0.1)
    opt.step(lr=0.5)
    assert opt.last_lr == 0.5
    for p in params:
        decay = 0.1 if p.name == "w" else 0.0
        assert np.allclose(p.data, w0[p.name] - 0.5 * (g0[p.name] + decay * w0[p.name]),
                           rtol=1e-13)
        assert np.array_equal(p.grad, g0[p.name])  # the optimizer never writes .grad
    opt.zero_grad()
    assert all(not p.grad.any() for p in params)


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
])
def test_float32_stays_float32(make):
    params = make_params(F32)
    opt = make(params)
    rng = np.random.default_rng(4)
    for _ in range(3):
        for p in params:
            p.grad[...] = rng.normal(size=p.shape).astype(np.float32)
        opt.step(lr=np.float64(3e-3))  # a NumPy float64 lr must not promote the math
    for p in params:
        assert p.data.dtype == np.float32
        assert all(b.dtype == np.float32 for b in opt.state[p.name].values())
    # and the same run in float64 agrees to float32 rounding
    params64 = make_params(F64)
    opt64 = make(params64)
    rng = np.random.default_rng(4)
    for _ in range(3):
        for p in params64:
            p.grad[...] = rng.normal(size=p.shape).astype(np.float32)
        opt64.step(lr=3e-3)
    for p, q in zip(params, params64, strict=True):
        assert np.allclose(p.data, q.data, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(5)
    a = make_params()
    opt_a = AdamW(a, lr=0.01, weight_decay=0.1)
    run_opt(opt_a, a, 3, rng)
    sd = opt_a.state_dict()
    assert set(sd) == {"w", "b", "ln.g"}
    assert sd["w"]["exp_avg"].shape == (5, 3) and sd["w"]["step"] == 3
    # a copy, not the live buffer
    sd["w"]["exp_avg"] += 0.0
    assert sd["w"]["exp_avg"] is not opt_a.state["w"]["exp_avg"]

    b = make_params(seed=9)
    for p, q in zip(a, b, strict=True):
        q.data[...] = p.data
    opt_b = AdamW(b, lr=0.01, weight_decay=0.1)
    opt_b.load_state_dict(sd)
    assert opt_b.step_count == 3
    for opt, ps in ((opt_a, a), (opt_b, b)):
        set_grads(ps, np.random.default_rng(6))
        opt.step()
    for p, q in zip(a, b, strict=True):
        assert np.array_equal(p.data, q.data)


def test_sgd_state_dict_round_trip():
    a = make_params()
    opt = SGD(a, lr=0.1, momentum=0.9)
    run_opt(opt, a, 2, np.random.default_rng(7))
    sd = opt.state_dict()
    assert set(sd["w"]) == {"momentum_buffer", "step"}
    opt2 = SGD(make_params(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(sd)
    assert np.array_equal(opt2.state["w"]["momentum_buffer"], opt.state["w"]["momentum_buffer"])


def test_load_state_dict_errors_name_the_problem():
    params = make_params()
    opt = AdamW(params, lr=0.01)
    sd = opt.state_dict()

    missing = {k: v for k, v in sd.items() if k != "b"}
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        opt.load_state_dict(missing)

    extra = dict(sd, bogus=sd["b"])
    with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
        opt.load_state_dict(extra)

    bad_shape = {k: dict(v) for k, v in sd.items()}
    bad_shape["w"]["exp_avg"] = np.zeros((5, 1))
    with pytest.raises(ValueError, match=r"w.exp_avg has shape \(5, 1\).*\(5, 3\)"):
        opt.load_state_dict(bad_shape)

    with pytest.raises(ValueError, match="momentum_buffer"):
        SGD(params, lr=0.1, momentum=0.9).load_state_dict(sd)

    # a failed load changed nothing
    assert not opt.state["w"]["exp_avg"].any()


def test_constructor_errors():
    params = make_params()
    with pytest.raises(ValueError, match="unique"):
        AdamW(params + [params[0]], lr=0.1)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        AdamW(params, lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        SGD(params, lr=-1.0)
    with pytest.raises(ValueError, match="empty"):
        SGD([], lr=0.1)


# --- weight decay by role ------------------------------------------------------------------


def test_decay_follows_the_declared_role_not_the_shape():
    """A (3, d) bias (the fused qkv bias's layout) is a bias: not decayed; a (d,) weight role is."""
    fused_bias = Parameter("qkv.bias", (3, 4), F64, role="bias", init="zeros")
    assert not decays(fused_bias)
    assert decays(Parameter("e", (7, 4), F64, role="embedding"))
    assert not decays(Parameter("ln.weight", (4,), F64, role="norm", init="ones"))
    with pytest.raises(ValueError, match="role 'matrix'"):
        Parameter("w", (2, 2), F64, role="matrix")


def test_adamw_weight_decay_does_not_shrink_a_2d_bias():
    """One AdamW step with zero gradients: only weight decay can move a parameter. The 2-D
    bias keeps its value bit for bit; the weight shrinks by exactly 1 - lr * wd."""
    w = Parameter("w", (3, 4), F64, role="weight", std=1.0)
    b = Parameter("qkv.bias", (3, 4), F64, role="bias", init="ones")
    w0, b0 = w.data.copy(), b.data.copy()
    AdamW([w, b], lr=0.1, weight_decay=0.5).step()
    assert np.array_equal(b.data, b0)
    assert np.array_equal(w.data, w0 * (1.0 - 0.1 * 0.5))


# --- clipping ------------------------------------------------------------------------------


def test_grad_norm_and_clip_scale():
    params = make_params()
    set_grads(params, np.random.default_rng(8))
    want = math.sqrt(sum(float((p.grad**2).sum()) for p in params))
    assert math.isclose(norm(params), want, rel_tol=1e-13)
    before = [p.grad.copy() for p in params]

    scale = clip_grads_(params, max_norm=want / 4, total_norm=want)
    assert math.isclose(scale, (want / 4) / (want + 1e-6), rel_tol=1e-13)
    for p, g in zip(params, before, strict=True):
        assert np.allclose(p.grad, g * scale, rtol=1e-14)
    assert math.isclose(norm(params), want / 4, rel_tol=1e-6)


def test_clip_is_noop_below_threshold():
    params = make_params()
    set_grads(params, np.random.default_rng(9))
    before = [p.grad.copy() for p in params]
    total = norm(params)
    assert clip_grads_(params, max_norm=2 * total, total_norm=total) == 1.0
    assert all(np.array_equal(p.grad, g) for p, g in zip(params, before, strict=True))


def test_clip_rejects_non_finite_norm():
    params = make_params()
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        clip_grads_(params, 1.0, float("nan"))


def test_replicated_counted_once_over_tp():
    """Two fake tp ranks: a column-split weight (each holds half) and a replicated bias (both
    hold it). Summing the local squares over the ranks must give the full model's norm."""
    rng = np.random.default_rng(10)
    full_w, full_b = rng.normal(size=(4, 6)), rng.normal(size=(6,))
    ranks = []
    for r in range(2):
        w = Parameter("w", (4, 6), F64, role="weight", spec=ShardSpec(axis=1), tp_rank=r,
                      tp_size=2)
        b = Parameter("b", (6,), F64, role="bias", tp_rank=r, tp_size=2)
        w.grad[...] = full_w[:, 3 * r: 3 * r + 3]
        b.grad[...] = full_b
        ranks.append([w, b])
    want_sq = float((full_w**2).sum() + (full_b**2).sum())
    local = [grad_norm_sq_local(ps) for ps in ranks]
    assert math.isclose(local[1], float((full_w[:, 3:] ** 2).sum()), rel_tol=1e-13)  # no bias
    assert math.isclose(sum(local), want_sq, rel_tol=1e-13)


# --- lr schedule ---------------------------------------------------------------------------


def test_lr_schedule_values():
    base, warm, total, lo = 1e-3, 10, 110, 1e-4
    assert lr_at(0, base, warm, total, lo) == pytest.approx(base / 10)
    assert lr_at(4, base, warm, total, lo) == pytest.approx(base * 5 / 10)
    assert lr_at(9, base, warm, total, lo) == pytest.approx(base)  # last warm-up step: peak
    assert lr_at(10, base, warm, total, lo) == pytest.approx(base)  # decay starts at the peak
    assert lr_at(60, base, warm, total, lo) == pytest.approx((base + lo) / 2)  # cosine midpoint
    assert lr_at(35, base, warm, total, lo) == pytest.approx(
        lo + 0.5 * (base - lo) * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, base, warm, total, lo) == pytest.approx(lo)
    assert lr_at(500, base, warm, total, lo) == pytest.approx(lo)
    lrs = [lr_at(s, base, warm, total, lo) for s in range(total)]
    assert all(b <= a for a, b in zip(lrs[warm:-1], lrs[warm + 1:], strict=True))  # monotone decay


def test_lr_constant_and_warmup_only():
    assert all(lr_at(s, 0.3, 0, 0) == 0.3 for s in range(5))
    assert lr_at(1, 0.3, 4, 0) == pytest.approx(0.15)
    assert lr_at(100, 0.3, 4, 0) == 0.3
    assert lr_at(0, 0.3, 0, 10) == pytest.approx(0.3)


def test_lr_schedule_errors():
    with pytest.raises(ValueError, match="below total_steps"):
        lr_at(0, 0.1, 10, 10)
    with pytest.raises(ValueError, match=">= 0"):
        lr_at(-1, 0.1, 0, 0)
    with pytest.raises(ValueError, match="min_lr"):
        lr_at(0, 0.1, 0, 10, min_lr=0.2)


@pytest.mark.parametrize("make_opt", [lambda ps: AdamW(ps, 1e-2, weight_decay=0.1),
                                      lambda ps: SGD(ps, 1e-2, momentum=0.9, weight_decay=0.1)],
                         ids=["adamw", "sgd"])
def test_optimizers_hand_blocks_to_the_threads_only_for_large_parameter_sets(make_opt,
                                                                             monkeypatch):
    """A small model's update runs on the calling thread (a hand-off costs more than it); the
    same update above ``PARALLEL_MIN_ELEMENTS`` goes to ``run_blocks``, with the same bits."""
    from mpipar.nn import cpu

    handed = []

    def run_blocks(items, fn):
        items = list(items)
        handed.append(len(items))
        for it in items:
            fn(it)

    monkeypatch.setattr(cpu, "run_blocks", run_blocks)
    results = []
    for threshold in (cpu.PARALLEL_MIN_ELEMENTS, 1):
        monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", threshold)
        params = make_params()
        run_opt(make_opt(params), params, 2, np.random.default_rng(1))
        results.append(snapshot(params))
    assert handed == [3, 3]  # two steps of three one-block parameters, threshold 1 only
    assert all(np.array_equal(results[0][k], results[1][k]) for k in results[0])
