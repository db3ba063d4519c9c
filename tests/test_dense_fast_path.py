"""The dense fast path (mpipar/nn/dense.py) computes what the layers compute, bit for bit: the
outputs, the losses, every input and weight gradient, in float32 and float64, for every way the
executor drives a chunk (one or several micro-batches in flight, split B / W, the first chunk,
recomputation, the units called one by one); and it is the path taken where a stack qualifies."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from mpi_util import ONE_THREAD, REPO, run_mpi

from mpipar.backend import Backend
from mpipar.models.mlp import build_mlp
from mpipar.nn import dense
from mpipar.nn.layers import GELU, Bias, LayerNorm, Linear, ParamFactory, ReLU, Sequential
from mpipar.parallel.pipeline.executor import Chunk, build_chunks

SIZES = [12, 9, 8, 7, 6, 5]  # five linears: units 0-4
DTYPES = [np.float32, np.float64]


def _model(dtype, activation="relu", sizes=SIZES, seed=0):
    mcfg = types.SimpleNamespace(sizes=list(sizes), activation=activation,
                                 task="classification", init_std=0.4, kind="mlp")
    return build_mlp(mcfg, Backend("cpu", np.dtype(dtype).name), seed=seed)


def _pair(dtype, lo, hi, activation="relu", sizes=SIZES):
    """Two chunks of units lo:hi of two identical models: on the layer path, on the fast path."""
    out = []
    for on in (False, True):
        model = _model(dtype, activation, sizes)
        chunk = Chunk(1 if lo else 0, model.units[lo:hi], lo)
        chunk.set_dense(on)
        assert chunk.path == ("dense" if on else "layers")
        out.append((model, chunk))
    return out


def _data(dtype, rows, width, mb, seed=1):
    rng = np.random.default_rng(seed + 10 * mb)
    return rng.standard_normal((rows, width)).astype(dtype)


def _same_grads(a, b):
    pa, pb = a.params(), b.params()
    assert len(pa) == len(pb)
    for p, q in zip(pa, pb, strict=True):
        assert p.grad.dtype == q.grad.dtype
        assert np.array_equal(p.grad, q.grad), p.name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("lo,hi", [(0, 5), (0, 1), (2, 3), (1, 4), (4, 5)],
                         ids=["all", "first", "middle-1", "middle-3", "last"])
def test_interleaved_micro_batches_equal_bit_for_bit(dtype, activation, lo, hi):
    """Several micro-batches in flight, F and BW interleaved (1F1B's order); the first chunk
    through backward_first, the others through backward (dx compared); the loss on the last."""
    (m_a, a), (m_b, b) = _pair(dtype, lo, hi, activation)
    last = hi == len(SIZES) - 1
    rows, d_in, d_out = 4, SIZES[lo], SIZES[hi]
    dys = {}
    for op in ["F0", "F1", "F2", "B1", "F3", "B0", "B3", "B2"]:
        mb = int(op[1])
        if op[0] == "F":
            x = _data(dtype, rows, d_in, mb)
            ys = [c.forward(x.copy(), mb) for c in (a, b)]
            assert ys[0].dtype == ys[1].dtype and np.array_equal(*ys)
            if last:  # the loss right after the last chunk's forward, as the executor does
                t = np.random.default_rng(mb).integers(0, d_out, rows)
                losses = [m.loss.forward(y, t, mb, 0.25) for m, y in zip((m_a, m_b), ys)]
                assert losses[0] == losses[1]
                dys[mb] = [m_a.loss.backward(mb), m_b.loss.backward(mb)]
                assert np.array_equal(*dys[mb])
            else:
                dys[mb] = [_data(dtype, rows, d_out, mb, seed=7)] * 2
        elif lo == 0:
            assert a.backward_first(dys[mb][0].copy(), mb) is None
            assert b.backward_first(dys[mb][1].copy(), mb) is None
        else:
            dxs = [c.backward(dy.copy(), mb) for c, dy in zip((a, b), dys[mb])]
            assert dxs[0].dtype == dxs[1].dtype and np.array_equal(*dxs)
    assert not a.in_flight() and not b.in_flight()
    _same_grads(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first", [False, True])
def test_split_backward_zb_h1_equal_bit_for_bit(dtype, first):
    """B (input gradients only) for several micro-batches, then their W in another order."""
    lo, hi = (0, 3) if first else (2, 5)
    (_, a), (_, b) = _pair(dtype, lo, hi)
    for mb in range(3):
        x = _data(dtype, 5, SIZES[lo], mb)
        assert np.array_equal(a.forward(x, mb), b.forward(x, mb))
    for mb in (1, 0, 2):
        dy = _data(dtype, 5, SIZES[hi], mb, seed=3)
        if first:
            assert a.backward_no_dx(dy, mb) is None and b.backward_no_dx(dy, mb) is None
        else:
            assert np.array_equal(a.backward_input(dy, mb), b.backward_input(dy, mb))
    for mb in (2, 1, 0):
        a.backward_weight(mb)
        b.backward_weight(mb)
    assert not a.in_flight() and not b.in_flight()
    _same_grads(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recompute_and_drop(dtype):
    """The executor's recomputation: forward, drop, forward again from the kept input."""
    (_, a), (_, b) = _pair(dtype, 1, 5)
    x, dy = _data(dtype, 3, SIZES[1], 0), _data(dtype, 3, SIZES[5], 0, seed=5)
    for c in (a, b):
        c.forward(x, 0)
        c.drop(0)
        assert not c.in_flight()
        c.forward(x, 0)
    assert np.array_equal(a.backward(dy, 0), b.backward(dy, 0))
    _same_grads(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_two_paths_take_turns_on_one_micro_batch(dtype):
    """The chunk's fast forward, then the executor's unit-by-unit last backward (data
    parallelism) on units that take the layer path: the saved contexts are the layers' own."""
    (_, a), (_, b) = _pair(dtype, 0, 5)
    for unit in b.layers:
        unit.set_dense(False)
    x, dy = _data(dtype, 4, SIZES[0], 0), _data(dtype, 4, SIZES[5], 0, seed=9)
    assert np.array_equal(a.forward(x, 0), b.forward(x, 0))  # b: the chunk is still dense
    a.backward_first(dy, 0)
    for i in range(len(b.layers) - 1, -1, -1):  # executor._backward_unit_by_unit
        unit = b.layers[i]
        dy = unit.backward_no_dx(dy, 0) if i == 0 else unit.backward_input(dy, 0)
        unit.backward_weight(0)
    assert not b.in_flight()
    _same_grads(a, b)


def test_inputs_of_more_axes_take_the_layer_path_with_the_same_bits():
    (_, a), (_, b) = _pair(np.float64, 1, 4)
    x = np.random.default_rng(0).standard_normal((2, 3, SIZES[1]))
    dy = np.random.default_rng(1).standard_normal((2, 3, SIZES[4]))
    assert np.array_equal(a.forward(x, 0), b.forward(x, 0))
    assert np.array_equal(a.backward_input(dy, 0), b.backward_input(dy, 0))
    a.backward_weight(0)
    b.backward_weight(0)  # dense, from contexts the layer path saved (3-D)
    _same_grads(a, b)


def test_inputs_of_another_dtype_than_the_weights_keep_the_kernels_choices():
    (_, a), (_, b) = _pair(np.float64, 0, 5)
    x, dy = _data(np.float32, 4, SIZES[0], 0), _data(np.float32, 4, SIZES[5], 0)
    ys = [c.forward(x, 0) for c in (a, b)]
    assert ys[0].dtype == ys[1].dtype and np.array_equal(*ys)
    a.backward_first(dy, 0)
    b.backward_first(dy, 0)
    _same_grads(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linears_without_bias_and_mixed_activations(dtype):
    def stack():
        pf = ParamFactory(Backend("cpu", np.dtype(dtype).name), seed=2, std=0.5)
        return Sequential([Linear(pf, "a", 6, 5, bias=False), GELU("g"),
                           Sequential([Linear(pf, "b", 5, 4), ReLU("r")]),
                           Linear(pf, "c", 4, 3, bias=False), Linear(pf, "d", 3, 2)])
    a, b = stack(), stack()
    assert a.set_dense(False) is False and b.path == "dense"
    for mb in range(2):
        x, dy = _data(dtype, 3, 6, mb), _data(dtype, 3, 2, mb, seed=4)
        assert np.array_equal(a.forward(x, mb), b.forward(x, mb))
        assert np.array_equal(a.backward(dy, mb), b.backward(dy, mb))
    _same_grads(a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_product_has_the_same_bits_on_one_thread_or_shared(threads):
    """Products above the pool's size: cpu.product and cpu.matmul's accumulation through the
    buffer pool, on the fast path as on the layers', made on the calling thread (one kernel
    thread) or shared by two kernel threads. The same bits either way."""
    from mpipar.nn import cpu

    sizes, rows = [512, 256, 4], 128  # the first linear's products: 128 * 512 * 256 >= 2^23
    before = cpu.kernel_threads()
    cpu.set_kernel_threads(threads)
    try:
        (m_a, a), (m_b, b) = _pair(np.float32, 0, 2, sizes=sizes)
        for mb in range(2):
            x = _data(np.float32, rows, sizes[0], mb)
            t = np.arange(rows) % 4
            for m, c in ((m_a, a), (m_b, b)):
                m.loss.forward(c.forward(x, mb), t, mb, 0.5)
                c.backward_first(m.loss.backward(mb), mb)
        _same_grads(a, b)
        assert b.path == "dense" and b._dense._plans  # the fast path made its plan
    finally:
        cpu.set_kernel_threads(before)


def test_the_fast_path_is_the_one_taken(monkeypatch):
    """With every layer's own passes broken, a dense chunk still trains; the layer path fails."""
    (_, a), (_, b) = _pair(np.float64, 0, 5)
    x, dy = _data(np.float64, 4, SIZES[0], 0), _data(np.float64, 4, SIZES[5], 0)
    b.forward(x, 0)
    b.backward_first(dy, 0)
    expected = [p.grad.copy() for p in b.params()]

    def broken(*_args, **_kw):
        raise AssertionError("a layer's own pass ran on the dense path")

    for cls in (Linear, ReLU):
        for name in ("forward", "backward_input", "backward_weight", "backward_no_dx",
                     "backward_first", "backward"):
            monkeypatch.setattr(cls, name, broken)
    assert a.set_dense(True) and a.path == "dense"
    a.forward(x, 0)
    a.backward_first(dy, 0)
    for p, g in zip(a.params(), expected, strict=True):
        assert np.array_equal(p.grad, g)
    a.set_dense(False)
    with pytest.raises(AssertionError, match="dense path"):
        a.forward(x, 1)


def test_which_stacks_qualify():
    pf = ParamFactory(Backend("cpu", "float64"), seed=0)
    lin = Linear(pf, "l", 4, 4)
    assert Sequential([Linear(pf, "a", 4, 4), ReLU("r"), Linear(pf, "b", 4, 4, bias=False),
                       GELU("g"), Linear(pf, "c", 4, 4)]).path == "dense"
    assert Sequential([Sequential([Linear(pf, "a", 4, 4), ReLU("r")])]).path == "dense"

    class MyLinear(Linear):
        pass

    class MyStack(Sequential):
        def forward(self, x, mb=0):
            return super().forward(x, mb)

    for layers in ([], [ReLU("r"), lin], [lin, ReLU("r"), ReLU("s")], [MyLinear(pf, "m", 4, 4)],
                   [lin, Bias(pf, "b", 4)], [lin, LayerNorm(pf, "n", 4)], [MyStack([lin])],
                   [Linear(pf, "q", 4, 12, w_shape=(4, 3, 4))]):
        assert Sequential(layers).path == "layers", layers
    assert MyStack([lin]).path == "layers"
    gpt_like = _model(np.float64, sizes=[4, 4])
    assert all(u.path == "dense" for u in gpt_like.units)


def test_the_switch_and_its_bad_values(monkeypatch):
    monkeypatch.setattr(dense, "ENABLED", False)
    model = _model(np.float64)
    assert all(u.path == "layers" for u in model.units)
    assert build_chunks(model, {0: (0, 5)}, 0, 1)[0].path == "layers"
    monkeypatch.setenv("MPIPAR_DENSE", "yes")
    with pytest.raises(ValueError, match="MPIPAR_DENSE='yes': set it to 1"):
        dense._enabled()
    monkeypatch.setenv("MPIPAR_DENSE", "0")
    assert dense._enabled() is False


# ----- whole runs: the same losses with the fast path as with the layers ------------------------

TRAIN = ["-m", "mpipar.cli", "train", "--steps", "3", "--set", "model.kind=mlp",
         "--set", "model.sizes=[784,32,31,30,29,10]", "--set", "model.activation=relu",
         "--set", "train.batch_size=16", "--set", "train.optimizer=sgd",
         "--set", "train.eval_interval=0", "--set", "train.dtype=float64", "--quiet"]


def _losses(tmp_path, name, ranks, flags, on):
    out = tmp_path / f"{name}-{on}"
    env = {**ONE_THREAD, "MPIPAR_DENSE": str(on)}
    args = [sys.executable, *TRAIN, *flags, "--out", str(out)]
    if ranks == 1:
        full = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        res = subprocess.run(args, env=full, cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    else:
        res = run_mpi(ranks, args, env=env, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())["losses"]


RUNS = [("1rank", 1, ["--microbatches", "2"]),
        ("1rank-zb-h1-recompute", 1, ["--schedule", "zb-h1", "--microbatches", "4",
                                      "--set", "parallel.recompute=true"]),
        ("pp2-1f1b", 2, ["--pp", "2", "--microbatches", "4"]),
        ("pp2-zb-h1", 2, ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "4"]),
        ("dp2", 2, ["--dp", "2", "--microbatches", "2"])]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name,ranks,flags", RUNS, ids=[r[0] for r in RUNS])
def test_training_losses_are_those_of_the_layer_path(tmp_path, name, ranks, flags):
    layers = _losses(tmp_path, name, ranks, flags, 0)
    fast = _losses(tmp_path, name, ranks, flags, 1)
    assert len(layers) == 3 and layers == fast


@pytest.mark.slow
def test_the_microbenchmark_runs(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "experiments" / "lean_chunk.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "MLP" in line]
    assert len(rows) == 3 and all(len(r.split("|")) == 8 for r in rows), res.stdout


def test_the_per_operation_microbenchmark_runs():
    """experiments/lean_ops.py on the small MLP: every variant and every part gets a row."""
    res = subprocess.run([sys.executable, str(REPO / "experiments" / "lean_ops.py"), "--quick",
                          "--small"], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    names = [line.split("|")[1].strip() for line in res.stdout.splitlines()
             if line.startswith("| ") and not line.startswith("| variant")
             and not line.startswith("| part")]
    assert names == ["lean", "layers", "+fwd", "+relu", "+dw", "+db", "+dx", "fwd", "bias",
                     "relu", "loss", "mask", "dw", "db", "dx"], res.stdout


# ----- the whole vocabulary's cross-entropy in fewer calls ----------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 10), (8, 10), (1, 3), (2, 5, 7)])
def test_cross_entropy_in_fewer_calls_has_the_same_bits(dtype, shape):
    from mpipar.nn import losses

    rng = np.random.default_rng(4)
    logits = (rng.standard_normal(shape) * 3).astype(dtype)
    targets = rng.integers(0, shape[-1], shape[:-1])
    got = losses.cross_entropy_whole(logits.copy(), targets)
    assert got is not None
    for reduce in (losses._local, lambda x, op: x):  # unmasked and masked general paths
        want = losses.cross_entropy_forward(logits.copy(), targets, 0, reduce)
        assert got[0] == want[0]
        assert np.array_equal(got[1][0], want[1][0])
        g = losses.cross_entropy_backward((got[1][0].copy(), *got[1][1:]), 0.25)
        w = losses.cross_entropy_backward((want[1][0].copy(), *want[1][1:]), 0.25)
        assert g.shape == logits.shape and g.dtype == w.dtype and np.array_equal(g, w)
    loss = losses.CrossEntropyLoss()  # the object takes it, and gives the same
    assert loss.forward(logits.copy(), targets, 0, 0.5) == got[0]
    assert np.array_equal(loss.backward(0),
                          losses.cross_entropy_backward((got[1][0].copy(), *got[1][1:]), 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loss_mean_without_numpys_wrapper_is_numpys_mean(dtype):
    from mpipar.nn import losses

    rng = np.random.default_rng(6)
    for n in list(range(1, 70)) + [128, 255, 256, 1000, 4096]:
        for scale in (1e-3, 1.0, 7.0, 1e4):
            v = (rng.standard_normal(n) * scale).astype(dtype)
            assert losses._mean(v, n) == float(v.mean()), (n, scale)


def test_cross_entropy_targets_outside_the_vocabulary_take_the_general_path():
    from mpipar.nn import losses

    logits = np.random.default_rng(5).standard_normal((4, 6))
    for t in ([0, 6, 1, 2], [0, -1, 1, 2], np.array([0.0, 1.0, 2.0, 3.0]),
              np.array([0, -1, 1, 2], np.int32), np.array([0, 1, -128, 2], np.int8),
              np.array([0, 6, 1, 2], np.uint8), np.array([[0, 1], [-3, 2]])[:, 0]):
        assert losses.cross_entropy_whole(logits.copy(), np.asarray(t)) is None
    for t in (np.array([0, 5, 1, 2], np.int16), np.array([[0, 1], [5, 2]])[:, 0].repeat(2)):
        assert losses.cross_entropy_whole(logits.copy(), t) is not None
    t = np.array([0, 7, 1, 2])  # the masked path: the outside target picks nothing
    loss = losses.CrossEntropyLoss().forward(logits.copy(), t)
    assert loss == losses.cross_entropy_forward(logits.copy(), t, 0, lambda x, op: x)[0]


@pytest.mark.gpu
def test_the_fast_path_on_cupy_equals_the_layers():
    from mpipar.backend import cupy_available, to_numpy

    ok, why = cupy_available()
    if not ok:
        pytest.skip(f"no GPU: {why}")
    pair = []
    for on in (False, True):
        mcfg = types.SimpleNamespace(sizes=SIZES, activation="gelu", task="classification",
                                     init_std=0.4, kind="mlp")
        model = build_mlp(mcfg, Backend("cuda", "float64"))
        chunk = Chunk(0, model.units, 0)
        assert chunk.set_dense(on) is on
        pair.append((model, chunk))
    import cupy

    x = cupy.asarray(_data(np.float64, 6, SIZES[0], 0))
    t = cupy.asarray(np.arange(6) % SIZES[-1])
    outs = []
    for model, chunk in pair:
        loss = model.loss.forward(chunk.forward(x, 0), t, 0, 0.5)
        chunk.backward_first(model.loss.backward(0), 0)
        outs.append((loss, [to_numpy(p.grad) for p in chunk.params()]))
    assert outs[0][0] == outs[1][0]
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        assert np.array_equal(a, b)
