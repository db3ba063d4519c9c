"""2D (Optimus / SUMMA), 2.5D (Tesseract) and 3D tensor parallelism (issue 17): shapes refused
before work, the multi-axis ShardSpec, finite-difference checks of every new layer, the byte
count of each paper and memory per rank, checkpoints moving between modes, the experiment.
Equivalence to one rank: tests/test_parallel_equivalence.py (``2d`` variants on the tp = 4 grids,
2.5d and 3d at 8 ranks)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import python_script, run_mpi

from mpipar.config import ConfigError, load_config
from mpipar.datasets import prepare_synthetic
from mpipar.layout import GridError, tp_grid_shape
from mpipar.nn.params import ShardSpec, assemble, take_shard
from mpipar.training import check_model


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.h5"
    prepare_synthetic(path, "markov", 20000, 256, seed=0)
    return str(path)


@pytest.mark.parametrize("mode, tp, depth, shape", [
    ("1d", 6, 1, (6,)), ("2d", 4, 1, (2, 2)), ("2d", 9, 1, (3, 3)), ("2.5d", 8, 2, (2, 2, 2)),
    ("3d", 8, 1, (2, 2, 2)), ("3d", 27, 1, (3, 3, 3))])
def test_tp_grid_shapes(mode, tp, depth, shape):
    assert tp_grid_shape(mode, tp, depth) == shape


@pytest.mark.parametrize("over, words", [
    ({"parallel.tp": "8", "parallel.tp_mode": "2d"}, r"tp_mode 2d needs tp = q\^2 .* got 8"),
    ({"parallel.tp": "4", "parallel.tp_mode": "3d"}, r"q\^3 .* got tp = 4"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "parallel.tp_depth": "2"},
     "tp_depth = 2 only applies to tp_mode 2.5d"),
    ({"parallel.tp": "6", "parallel.tp_mode": "2.5d", "parallel.tp_depth": "4"},
     "does not divide by tp_depth = 4"),
    ({"parallel.tp": "4", "parallel.tp_mode": "4d"}, "parallel.tp_mode = '4d': must be one of"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "parallel.tp_depth": "0"},
     "tp_depth = 0: must be an integer"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "model.n_head": "3", "model.n_embd": "48"},
     "model.n_head = 3 is not divisible by q = 2"),
    ({"parallel.tp": "9", "parallel.tp_mode": "2d", "model.n_head": "3", "model.n_embd": "48",
      "train.batch_size": "3", "model.vocab_size": "256"}, "model.vocab_size = 256 is not "
     "divisible by q = 3"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "train.batch_size": "3"},
     "multiple of 2"),
    ({"parallel.tp": "8", "parallel.tp_mode": "3d", "train.batch_size": "4",
      "model.n_embd": "18", "model.n_head": "2"}, "model.n_embd = 18 is not divisible by 4"),
    ({"parallel.tp": "8", "parallel.tp_mode": "3d", "train.batch_size": "2"}, "multiple of 4"),
    ({"parallel.tp": "8", "parallel.tp_mode": "2.5d", "parallel.tp_depth": "2",
      "train.batch_size": "4", "model.n_head": "3", "model.n_embd": "48"},
     r"model.n_head = 3 is not divisible by q = 2 \(tp_mode 2.5d\)"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "parallel.sequence_parallel": "true",
      "train.batch_size": "2"}, "sequence_parallel = true is for tp_mode 1d"),
    ({"parallel.tp": "4", "parallel.tp_mode": "2d", "model.kind": "mlp",
      "model.sizes": "[8, 8]", "train.batch_size": "2"}, "builds the GPT only"),
])
def test_bad_tp_shapes_are_refused_before_work(over, words):
    with pytest.raises(ConfigError, match=words):
        check_model(load_config(None, over))


def test_tp_grid_error_is_a_grid_error():
    with pytest.raises(GridError):
        tp_grid_shape("2d", 5)


def test_two_axis_shard_spec_round_trip():
    full = np.arange(4 * 3 * 6, dtype=float).reshape(4, 3, 6)
    spec = ShardSpec(split=((0, 0), (2, 1)), grid=(2, 2))
    shards = [take_shard(full, spec, r, 4) for r in range(4)]
    assert shards[1].shape == (2, 3, 3)
    np.testing.assert_array_equal(shards[1], full[:2, :, 3:])  # rank 1 = (row 0, column 1)
    np.testing.assert_array_equal(assemble(shards, spec, full.shape), full)
    vec = ShardSpec(split=((0, 1),), grid=(2, 2))  # cut by column, replicated over rows
    assert [vec.owns(r) for r in range(4)] == [True, True, False, False]
    assert not vec.replicated and ShardSpec().replicated
    nested = ShardSpec(split=((0, 0), (0, 1)), grid=(2, 2))  # one axis cut twice: 4 blocks
    np.testing.assert_array_equal(take_shard(np.arange(8.0), nested, 2, 4), [4.0, 5.0])


MODES = [(4, "2d"), (8, "2.5d"), (8, "3d")]


@pytest.mark.mpi
@pytest.mark.parametrize("n, mode", MODES, ids=[m for _, m in MODES])
def test_nd_layers_match_finite_differences(n, mode):
    res = python_script(n, "tp_nd_gradcheck.py", mode, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count("ok  ") == (7 if mode == "3d" else 6), res.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n, mode", MODES, ids=[m for _, m in MODES])
def test_nd_bytes_match_the_papers_and_memory_shrinks(tokens, n, mode):
    res = python_script(n, "tp_nd_count.py", tokens, 2, mode, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert f"ok {mode} L=2" in res.stdout


def _train(tokens, out, n, *extra):
    args = [sys.executable, "-m", "mpipar.cli", "train", "--data", tokens, "--out", str(out),
            "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=4",
            "--set", "model.block_size=8", "--seq-len", "8", "--batch-size", "8",
            "--set", "train.eval_interval=0", "--quiet", "--steps", "6", "--dtype", "float64",
            "--microbatches", "2", *extra]
    res = run_mpi(n, args, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((Path(out) / "metrics.json").read_text())["losses"]


@pytest.mark.mpi
def test_checkpoint_written_in_2d_resumes_in_1d_3d_and_back(tokens, tmp_path):
    full = _train(tokens, tmp_path / "a", 4, "--tp", "4", "--tp-mode", "2d",
                  "--set", "run.checkpoint_interval=3")
    ck = tmp_path / "a" / "checkpoints" / "step_000003.h5"
    one_d = _train(tokens, tmp_path / "b", 2, "--tp", "2", "--resume", str(ck))
    assert np.max(np.abs(np.subtract(one_d, full[3:])) / np.abs(full[3:])) <= 1e-9
    three_d = _train(tokens, tmp_path / "e", 8, "--tp", "8", "--tp-mode", "3d", "--resume",
                     str(ck))
    assert np.max(np.abs(np.subtract(three_d, full[3:])) / np.abs(full[3:])) <= 1e-9
    ck1 = tmp_path / "c"
    _train(tokens, ck1, 1, "--set", "run.checkpoint_interval=3")
    back = _train(tokens, tmp_path / "d", 4, "--tp", "4", "--tp-mode", "2d", "--resume",
                  str(ck1 / "checkpoints" / "step_000003.h5"))
    assert np.max(np.abs(np.subtract(back, full[3:])) / np.abs(full[3:])) <= 1e-9


@pytest.mark.mpi
def test_tp_modes_experiment_quick_bytes_match_formulas(tmp_path):
    exp = Path(__file__).resolve().parent.parent / "experiments" / "tp_modes.py"
    res = run_mpi(1, [sys.executable, str(exp), "--quick", "--out", str(tmp_path)], timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["ranks"], r["mode"]) for r in rows] == [(1, "1d"), (4, "1d"), (4, "2d"),
                                                       (8, "1d"), (8, "2.5d"), (8, "3d")]
    for r in rows:
        assert r["MiB_step"] == pytest.approx(r["pred_MiB"], rel=1e-12), r
    for r in rows[2:3] + rows[4:]:  # 2d, 2.5d, 3d: activations 1/tp of one rank's
        assert abs(r["act_ratio"] / r["ideal"] - 1) < 0.05, r
