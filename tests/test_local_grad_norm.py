"""LocalGradNorm: grad_norm_sq_local with its per-tensor work prepared once, bit for bit."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.nn.optim import LocalGradNorm, grad_norm_sq_local
from mpipar.nn.params import Parameter, ShardSpec


def _params(dtype, tp_rank=0):
    be = Backend("cpu", dtype)
    return [Parameter("w", (37, 29), be, role="weight", std=0.5, seed=1),
            Parameter("b", (29,), be, role="bias", std=0.5, seed=2),
            Parameter("ws", (8, 6), be, role="weight", spec=ShardSpec(axis=1), tp_rank=tp_rank,
                      tp_size=2, seed=3),
            Parameter("rep", (5,), be, role="bias", tp_rank=tp_rank, tp_size=2, seed=4)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_same_bits_as_grad_norm_sq_local_over_steps(dtype, tp_rank):
    params = _params(dtype, tp_rank)
    norm = LocalGradNorm(params)
    rng = np.random.default_rng(0)
    for step in range(3):
        for p in params:
            p.grad[...] = rng.normal(size=p.shape) * 10.0 ** step
        got, want = norm(), grad_norm_sq_local(params)
        assert type(got) is float and got == want  # the same bits, not just close


def test_a_rebound_or_strided_gradient_is_read_afresh():
    params = _params("float64")
    norm = LocalGradNorm(params)
    norm()
    params[0].grad = np.full((37, 29), 2.0)  # rebound: the cached view would be stale
    assert norm() == grad_norm_sq_local(params)
    params[1].grad = np.arange(58.0)[::2]  # not contiguous: raveled per call (a copy)
    assert norm() == grad_norm_sq_local(params)
    params[1].grad[...] = 3.0  # written in place: the strided view is read again
    assert norm() == grad_norm_sq_local(params)


def test_no_counted_tensor_gives_zero():
    params = _params("float64", tp_rank=1)[3:]  # a replicated parameter off tp rank 0
    assert LocalGradNorm(params)() == 0.0 == grad_norm_sq_local(params)
