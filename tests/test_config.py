"""The config alone: pure (no model, no MPI), one validator per section, and the grid rules it
shares with mpipar.mpi.grid (the same rule, the same message)."""

import subprocess
import sys

import pytest

from mpipar.backend import Backend
from mpipar.config import ConfigError, ModelConfig, load_config, validate
from mpipar.layout import GridError, check_grid, parse_order
from mpipar.models import build_model, unit_count


def test_config_is_a_leaf():
    code = ("import sys, mpipar.config\n"
            "bad = [m for m in sys.modules if m.startswith(('mpipar.', 'numpy', 'mpi4py'))\n"
            "       and m not in ('mpipar.config', 'mpipar.layout')]\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("over, words", [
    ({"model.kind": "cnn"}, "model.kind = 'cnn'"),
    ({"model.vocab_size": "1"}, "vocab_size must be at least 2"),
    ({"model.kind": "mlp", "model.sizes": "[4]"}, "at least an input and an output"),
    ({"model.kind": "mlp", "model.activation": "tanh"}, "model.activation"),
    ({"model.kind": "mlp", "model.task": "ranking"}, "model.task"),
    ({"train.dtype": "float16"}, "train.dtype"),
    ({"train.device": "tpu"}, "train.device"),
    ({"train.optimizer": "lamb"}, "train.optimizer"),
    ({"train.steps": "0"}, "train.steps must be at least 1"),
    ({"parallel.pp": "0"}, r"--pp must be an integer >= 1, got 0 \(config: parallel.pp\)"),
    ({"parallel.microbatches": "0"}, "parallel.microbatches must be at least 1"),
    ({"parallel.schedule_file": "/no/such.txt"}, "not found"),
    ({"parallel.zero1": "true", "parallel.schedule": "pipedream"}, "ZeRO-1"),
])
def test_each_section_names_the_field(over, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, over)


def test_grid_rules_are_the_grids():
    """Rank order and world size: the config raises the grid's own message."""
    with pytest.raises(GridError) as grid_err:
        parse_order("tp-pp")
    with pytest.raises(ConfigError) as cfg_err:
        load_config(None, {"parallel.order": "tp-pp"})
    assert str(cfg_err.value) == str(grid_err.value)
    cfg = load_config(None, {"parallel.dp": "2", "parallel.pp": "2", "parallel.microbatches": "2"})
    validate(cfg, 4)
    with pytest.raises(GridError) as grid_err:
        check_grid(2, 2, 1, 3)
    with pytest.raises(ConfigError, match="mpiexec -n 4") as cfg_err:
        validate(cfg, 3)
    assert str(cfg_err.value) == str(grid_err.value)


@pytest.mark.parametrize("mcfg", [
    ModelConfig(kind="gpt", n_layer=3, n_embd=8, n_head=2, block_size=8),
    ModelConfig(kind="gpt", n_layer=1, n_embd=8, n_head=2, block_size=8, tie_embeddings=True),
    ModelConfig(kind="mlp", sizes=[4, 6, 6, 3]),
    ModelConfig(kind="mlp", sizes=[4, 3]),
])
def test_unit_count_is_what_build_model_makes(mcfg):
    model = build_model(mcfg, Backend("cpu", "float64"))
    assert unit_count(mcfg) == len(model.units)
