"""The exactness tests on CuPy: every kernel and the whole models agree with NumPy (float64).

Skipped, with the reason, where CuPy or a CUDA device is missing. experiments/gpu_check.py runs
these and prints a CuPy vs NumPy agreement and timing table.
"""

import numpy as np
import pytest

from mpipar.backend import Backend, cupy_available, to_numpy

OK, WHY = cupy_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU: {WHY}")]


def rel(a, b):
    a, b = to_numpy(a), to_numpy(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def run_model(mcfg, backend, x, y, seed=3):
    from test_models import randomize

    from mpipar.models import build_model

    model = build_model(mcfg, backend, seed=seed)
    randomize(model, 11)  # same host-side random values on both backends
    xp = backend.xp
    h = xp.asarray(x) if mcfg.kind == "gpt" else xp.asarray(x, dtype=backend.dtype)
    for u in model.units:
        h = u.forward(h, 0)
    yy = xp.asarray(y) if mcfg.kind == "gpt" or mcfg.task == "classification" else \
        xp.asarray(y, dtype=backend.dtype)
    loss = model.loss.forward(h, yy, 0)
    d = model.loss.backward(0)
    for u in reversed(model.units):
        d = u.backward(d, 0)
    return loss, {p.name: to_numpy(p.grad) for p in model.params()}


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_model_on_cupy_equals_numpy(kind):
    from test_models import CASES, data_for

    mcfg = CASES[0] if kind == "gpt" else CASES[2]
    x, y = data_for(mcfg, np.random.default_rng(0))
    l_np, g_np = run_model(mcfg, Backend("cpu", "float64"), x, y)
    l_cp, g_cp = run_model(mcfg, Backend("cuda", "float64"), x, y)
    assert abs(l_np - l_cp) <= 1e-12 * abs(l_np)
    for name in g_np:
        assert rel(g_cp[name], g_np[name]) <= 1e-10, name


def test_kernels_on_cupy_equal_numpy():
    import cupy as cp

    from mpipar.nn import functional as F

    rng = np.random.default_rng(1)
    q, k, v, c = (rng.normal(size=(2, 3, 5, 4)) for _ in range(4))
    mask = F.causal_mask(np, 5, 5)
    out, p = F.attention_forward(q, k, v, mask)
    out_c, p_c = F.attention_forward(*(cp.asarray(a) for a in (q, k, v)), cp.asarray(mask))
    assert rel(out_c, out) <= 1e-12
    for a, b in zip(F.attention_backward(cp.asarray(c), cp.asarray(q), cp.asarray(k),
                                         cp.asarray(v), p_c),
                    F.attention_backward(c, q, k, v, p)):
        assert rel(a, b) <= 1e-12
    x = rng.normal(size=(4, 7))
    assert rel(F.gelu_forward(cp.asarray(x))[0], F.gelu_forward(x)[0]) <= 1e-13


def test_float32_stays_float32_on_cupy():
    import cupy as cp
    from test_models import gpt_cfg

    from mpipar.models import build_model

    model = build_model(gpt_cfg(), Backend("cuda", "float32"))
    h = cp.asarray(np.random.default_rng(0).integers(0, 13, size=(2, 6)))
    for u in model.units:
        h = u.forward(h, 0)
        assert h.dtype == cp.float32


@pytest.mark.mpi
def test_comm_layer_moves_cupy_arrays():
    """Point-to-point and collectives on CuPy arrays, staged and as detected (2 ranks, one GPU)."""
    from mpi_util import python_script

    for env in ({"MPIPAR_CUDA_AWARE": "0"}, {}):
        res = python_script(2, "comm_gpu.py", env=env, timeout=180)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
