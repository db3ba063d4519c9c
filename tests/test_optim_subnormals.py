"""Optimizer state that decays towards zero is flushed of subnormal values every
``optim.FLUSH_EVERY`` steps (subnormal arithmetic is slow on x86), and the flush changes no
update: weights bit for bit those of an optimizer that never flushes."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn import optim
from mpipar.nn.optim import SGD, AdamW
from mpipar.nn.params import Parameter


def subnormal(a) -> int:
    return int(np.count_nonzero((a != 0) & (np.abs(a) < np.finfo(a.dtype).tiny)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_flush_zeroes_subnormals_and_nothing_else(dtype):
    tiny = np.finfo(dtype).tiny
    a = np.array([0.0, -0.0, tiny, -tiny, tiny / 2, -tiny / 3, tiny / 2**20, 1e-3, -7.0],
                 dtype=dtype)
    keep = a.copy()
    optim.flush_subnormals(np, a, np.empty_like(a), np.empty(a.shape, bool))
    assert a[4:7].tolist() == [0.0, 0.0, 0.0]
    assert np.array_equal(np.delete(a, [4, 5, 6]), np.delete(keep, [4, 5, 6]))
    assert subnormal(a) == 0


def _params(dtype):
    backend = Backend("cpu", dtype)
    return [Parameter(f"p{i}", s, backend, role=r, std=0.5, seed=i)
            for i, (r, s) in enumerate([("weight", (40, 30)), ("bias", (30,))])]


def _drive(opt, params, steps, dead):
    """Random gradients for 20 steps, then zero where ``dead`` (the state decays) and random
    elsewhere."""
    rng = np.random.default_rng(1)
    for k in range(steps):
        for p, d in zip(params, dead):
            g = rng.standard_normal(p.shape).astype(p.data.dtype)
            if k >= 20:
                g[d] = 0
            p.grad[...] = g
        opt.step()


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: SGD(ps, lr=1e-3, momentum=0.9, nesterov=True),
], ids=["adamw", "sgd-momentum"])
def test_the_flush_keeps_the_updates_and_leaves_no_lasting_subnormals(make):
    """float32 AdamW moments reach the subnormal range after about 800 (first) and 1,600
    (second) steps of zero gradients, and without a flush some stay there for good (the decay
    rounds back to the same subnormal); SGD's momentum buffer after about 850."""
    steps = 2400
    flushing, plain = _params("float32"), _params("float32")
    dead = [np.arange(p.size).reshape(p.shape) % 3 == 0 for p in flushing]
    a, b = make(flushing), make(plain)
    b._flushes = lambda: False
    _drive(a, flushing, steps, dead)
    _drive(b, plain, steps, dead)
    for p, q in zip(flushing, plain):
        assert np.array_equal(p.data, q.data)
    state = lambda o: [x for bufs in o.state.values() for x in bufs.values()]  # noqa: E731
    assert sum(subnormal(x) for x in state(b)) > 0  # the case the flush is for did arise
    assert steps % optim.FLUSH_EVERY == 0
    assert sum(subnormal(x) for x in state(a)) == 0  # flushed at the last step


def test_flushes_fall_on_the_same_steps_after_a_resume():
    ps = _params("float32")
    opt = AdamW(ps, lr=1e-3)
    flushed = []
    for _ in range(3 * optim.FLUSH_EVERY):
        opt.step_count += 1
        flushed.append(opt._flushes())
    again = AdamW(_params("float32"), lr=1e-3)
    again.load_state_dict(opt.state_dict())
    assert flushed.count(True) == 3
    assert again._flushes() == flushed[-1]


def test_flush_on_another_array_module_takes_no_host_test():
    """Off NumPy (CuPy) the flush writes without asking ``mask.any()`` first (that would wait
    for the device): the same result through the module's own functions."""
    import types

    xp = types.SimpleNamespace(abs=np.abs, less=np.less, copyto=np.copyto, finfo=np.finfo)
    tiny = np.finfo(np.float32).tiny
    a = np.array([tiny / 4, 1.0, -tiny / 8, 0.0], dtype=np.float32)
    optim.flush_subnormals(xp, a, np.empty_like(a), np.empty(a.shape, bool))
    assert a.tolist() == [0.0, 1.0, 0.0, 0.0]
