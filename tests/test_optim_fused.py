"""The fused (flat-group) optimizer step against the per-tensor one: the same bits.

Gradients packed in one flat buffer (as the trainer's buckets hold them) make one group; the
optimizer packs the data and state to match. Every update below is compared bit for bit with
``fused=False`` (one tensor at a time), in float32 (where a changed operation order would
show) and float64.
"""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn import cpu, optim
from mpipar.nn.optim import SGD, AdamW
from mpipar.nn.params import Parameter

ROLES = ["norm", "weight", "bias", "weight", "bias", "embedding", "norm", "norm", "weight"]
SHAPES = [(7,), (7, 5), (5,), (5, 9), (9,), (11, 7), (7,), (3,), (3, 4)]


def make(backend, packed: bool, order=None):
    """Parameters of mixed roles (decaying runs of one and two tensors); ``packed``: their
    gradients views of one flat buffer, in ``order`` (default: reversed, as the buckets)."""
    ps = [Parameter(f"p{i}", s, backend, role=r, std=0.5, seed=3)
          for i, (r, s) in enumerate(zip(ROLES, SHAPES))]
    if packed:
        order = order or list(reversed(range(len(ps))))
        flat = np.zeros(sum(ps[i].size for i in order) + 5, dtype=backend.dtype)  # + a tail
        off = 0
        for i in order:
            p = ps[i]
            p.grad = flat[off:off + p.size].reshape(p.shape)
            off += p.size
    return ps


def drive(opt, params, steps, seed=5, lrs=None):
    rng = np.random.default_rng(seed)
    for k in range(steps):
        for p in params:
            p.grad[...] = rng.normal(size=p.shape)
        opt.step(None if lrs is None else lrs[k])


def same_bits(a, b):
    return all(np.array_equal(x.data.view(np.uint8), y.data.view(np.uint8))
               for x, y in zip(a, b))


OPTS = {
    "adamw": lambda ps, f: AdamW(ps, 1e-2, weight_decay=0.1, fused=f),
    "adamw-nowd": lambda ps, f: AdamW(ps, 1e-2, fused=f),
    "sgd": lambda ps, f: SGD(ps, 0.1, fused=f),
    "sgd-wd-mom": lambda ps, f: SGD(ps, 0.1, momentum=0.9, weight_decay=0.05, fused=f),
    "sgd-nesterov": lambda ps, f: SGD(ps, 0.1, momentum=0.9, weight_decay=0.05, nesterov=True,
                                      fused=f),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OPTS))
def test_fused_step_is_bitwise_the_per_tensor_step(name, dtype):
    b = Backend("cpu", dtype)
    fused, plain = make(b, packed=True), make(b, packed=True)
    fo, po = OPTS[name](fused, True), OPTS[name](plain, False)
    assert len(fo.groups()) == 1 and len(po.groups()) == len(plain)  # one group vs per tensor
    drive(fo, fused, 4, lrs=[0.01, 0.02, 0.005, 0.01])
    drive(po, plain, 4, lrs=[0.01, 0.02, 0.005, 0.01])
    assert same_bits(fused, plain)
    ref = make(b, packed=False)
    assert not np.array_equal(fused[1].data, ref[1].data)  # it moved
    # the state, by parameter name, is the same too
    fs, ps_ = fo.state_dict(), po.state_dict()
    for k in fs:
        for buf in fs[k]:
            assert np.array_equal(np.asarray(fs[k][buf]), np.asarray(ps_[k][buf])), (k, buf)


def test_fused_groups_follow_the_gradient_layout():
    """Two packed buffers make two groups; a parameter whose gradient is alone makes its own;
    each parameter's data and state are views of its group's flat arrays."""
    b = Backend("cpu", "float64")
    ps = make(b, packed=True, order=[0, 1, 2, 3])  # 4..8 keep their own gradients
    g2 = np.zeros(ps[5].size + ps[6].size)
    ps[5].grad = g2[:ps[5].size].reshape(ps[5].shape)
    ps[6].grad = g2[ps[5].size:].reshape(ps[6].shape)
    opt = AdamW(ps, 1e-2, weight_decay=0.1)
    sizes = sorted(len(g.params) for g in opt.groups())
    assert sizes == [1, 1, 1, 2, 4]
    for g in opt.groups():
        for p in g.params:
            assert np.shares_memory(p.data, g.data) and np.shares_memory(p.grad, g.grad)
            assert np.shares_memory(opt.state[p.name]["exp_avg"], g.state["exp_avg"])
    plain = make(b, packed=False)
    drive(opt, ps, 3)
    drive(AdamW(plain, 1e-2, weight_decay=0.1, fused=False), plain, 3)
    assert same_bits(ps, plain)


def test_rebound_data_is_laid_out_again():
    """A parameter whose data was rebound (a weight swap left undone, a load that made new
    arrays) is packed again before the next step, its state kept: the steps stay exact."""
    b = Backend("cpu", "float32")
    fused, plain = make(b, packed=True), make(b, packed=True)
    fo, po = AdamW(fused, 1e-2, weight_decay=0.1), AdamW(plain, 1e-2, weight_decay=0.1,
                                                          fused=False)
    drive(fo, fused, 2)
    drive(po, plain, 2)
    first = fo.groups()[0]
    fused[3].data = fused[3].data.copy()  # rebound: no longer a view of the group
    assert not first.valid()
    drive(fo, fused, 2, seed=9)
    drive(po, plain, 2, seed=9)
    assert fo.groups()[0] is not first and fo.groups()[0].valid()
    assert same_bits(fused, plain)


def test_state_dict_and_load_keep_names_and_shapes():
    b = Backend("cpu", "float64")
    ps = make(b, packed=True)
    opt = AdamW(ps, 1e-2, weight_decay=0.1)
    drive(opt, ps, 2)
    sd = opt.state_dict()
    assert sorted(sd) == sorted(p.name for p in ps)
    assert all(sd[p.name]["exp_avg"].shape == p.shape for p in ps)
    # a fresh (per-tensor) optimizer loads it and continues with the same bits
    ps2 = make(b, packed=False)
    for p, q in zip(ps2, ps):
        p.data[...] = q.data
    opt2 = AdamW(ps2, 1e-2, weight_decay=0.1, fused=False)
    opt2.load_state_dict(sd)
    opt3 = AdamW(ps, 1e-2, weight_decay=0.1)
    opt3.load_state_dict(sd)  # loads into the packed state in place
    assert opt3.groups()[0].valid()
    drive(opt3, ps, 2, seed=7)
    drive(opt2, ps2, 2, seed=7)
    assert same_bits(ps, ps2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OPTS))
def test_fused_blocks_split_decay_runs_across_blocks(name, dtype, monkeypatch):
    """Blocks smaller than the tensors (and handed to the threads) cut decaying runs and
    momentum buffers in the middle: still the per-tensor bits, for every optimizer."""
    monkeypatch.setattr(optim, "OPT_BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(optim, "SGD_ONE_BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1)
    b = Backend("cpu", dtype)
    fused, plain = make(b, packed=True), make(b, packed=True)
    fo, po = OPTS[name](fused, True), OPTS[name](plain, False)
    drive(fo, fused, 3)
    drive(po, plain, 3)
    assert len(fo._blocks(fo.groups()[0], 0.1, False)) > 4  # really cut in blocks
    assert same_bits(fused, plain)
    fs, ps_ = fo.state_dict(), po.state_dict()
    assert all(np.array_equal(fs[k][buf], ps_[k][buf]) for k in fs for buf in fs[k])


def test_packed_copier_copies_each_packed_run_once():
    """The stash's copy of a chunk's weights: equal to each tensor's own copy, independent of
    the weights, one buffer per packed run; a plan made again when the arrays change."""
    from mpipar.nn.flat import PackedCopier

    b = Backend("cpu", "float32")
    ps = make(b, packed=True)
    AdamW(ps, 1e-2)  # packs the data to match the gradients
    arrays = [p.data for p in ps]
    cp = PackedCopier()
    got = cp.copy(arrays)
    assert all(np.array_equal(g, a) and g.shape == a.shape for g, a in zip(got, arrays))
    assert all(not np.shares_memory(g, a) for g, a in zip(got, arrays))
    assert len({id(np.asarray(g).base) for g in got}) == 1  # one copy for the whole run
    ps[2].data += 1  # the copies do not follow the weights
    assert not np.array_equal(got[2], ps[2].data)
    loose = [np.arange(6.0).reshape(2, 3), np.ones(4)]  # separate arrays: a copy each
    got = cp.copy(loose)
    assert all(np.array_equal(g, a) for g, a in zip(got, loose))
    assert not np.shares_memory(got[0], got[1]) and not np.shares_memory(got[0], loose[0])


@pytest.mark.parametrize("blocks", [None, 8])
@pytest.mark.parametrize("name", sorted(OPTS))
def test_zero_grad_step_is_the_same_update_and_leaves_the_gradients_zero(name, blocks,
                                                                         monkeypatch):
    """``step(zero_grad=True)`` (a continuous PipeDream run's UPDATE: each block's gradient
    zeroed after its last read) updates with the same bits as a step followed by a zeroing,
    in one block and in blocks cut through the tensors."""
    if blocks is not None:
        monkeypatch.setattr(optim, "OPT_BLOCK_ELEMENTS", blocks)
        monkeypatch.setattr(optim, "SGD_ONE_BLOCK_ELEMENTS", blocks)
    b = Backend("cpu", "float32")
    zeroed, plain = make(b, packed=True), make(b, packed=True)
    zo, po = OPTS[name](zeroed, True), OPTS[name](plain, True)
    rng_z, rng_p = np.random.default_rng(4), np.random.default_rng(4)
    for lr in (0.01, 0.02, 0.005):
        for ps, rng in ((zeroed, rng_z), (plain, rng_p)):
            for p in ps:
                p.grad += rng.normal(size=p.shape)  # accumulates, as a backward does
        zo.step(lr, zero_grad=True)
        po.step(lr)
        assert all(not p.grad.any() for p in zeroed)
        assert all(p.grad.any() for p in plain)
        po.zero_grad()
        assert same_bits(zeroed, plain)


def test_packed_copier_reuses_a_copy_only_once_nothing_holds_it():
    """A released copy's memory takes the next copy (the same addresses, the new values); one
    still referenced by any of its arrays, or by a view derived from one, is never written."""
    from mpipar.nn.flat import PackedCopier

    def addresses(arrays):
        return [a.__array_interface__["data"][0] for a in arrays]

    b = Backend("cpu", "float32")
    ps = make(b, packed=True)
    AdamW(ps, 1e-2)
    arrays = [p.data for p in ps] + [np.arange(12.0, dtype=np.float32).reshape(3, 4).T]
    cp = PackedCopier()
    first = cp.copy(arrays)
    at = addresses(first)
    del first
    ps[0].data += 1
    again = cp.copy(arrays)
    assert addresses(again) == at  # reused
    assert all(np.array_equal(g, a) for g, a in zip(again, arrays))  # with the new values
    held = again[3]  # one of its arrays still held
    del again
    before = held.copy()
    for p in ps:
        p.data += 1
    other = cp.copy(arrays)
    assert np.array_equal(held, before) and not np.shares_memory(other[3], held)
    derived = other[5].T  # a view derived from one of its arrays (its base: the buffer)
    del other  # (``held`` still keeps the first copy)
    before = derived.copy()
    for p in ps:
        p.data += 1
    last = cp.copy(arrays)
    assert np.array_equal(derived, before) and not np.shares_memory(last[5], derived)
    assert len(cp._pool) <= cp.POOL
