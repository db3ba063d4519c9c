"""Megatron's communication count, read from the tracer (tests/mpi/tp_count.py)."""

import pytest
from mpi_util import python_script

from mpipar.datasets import prepare_synthetic


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.h5"
    prepare_synthetic(path, "markov", 5000, 256, seed=0)
    return str(path)


@pytest.mark.mpi
@pytest.mark.parametrize("tp, layers, sp", [(2, 3, 0), (4, 2, 0), (2, 2, 1), (4, 3, 1)])
def test_tp_collectives_match_megatron_count(tokens, tp, layers, sp):
    res = python_script(tp, "tp_count.py", tokens, tp, layers, sp, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith("ok")
