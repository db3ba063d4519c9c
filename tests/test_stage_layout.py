"""Uneven pipeline stages from Megatron-style layout strings (issue 16)."""

import pytest

from mpipar.config import ConfigError, load_config
from mpipar.parallel.pipeline.stage_layout import LayoutError, expand, layout_bounds
from mpipar.training.preflight import check_model


def test_expand_and_bounds():
    assert expand("E,t|(t|)*2,t*3L") == "Et|t|t|tttL"
    assert expand("(E(t*2|)*2t)L") == "Ett|tt|tL"
    assert layout_bounds("Et|t*5L", 6, 2) == {0: (0, 2), 1: (2, 8)}
    assert layout_bounds("Et|(t|)*2,t*3L", 6, 4) == {0: (0, 2), 1: (2, 3), 2: (3, 4), 3: (4, 8)}


@pytest.mark.parametrize("text, match", [
    ("Et|t*5", "L must appear once, as the last unit"),
    ("tE|t*5L", "E must appear once, as the first unit"),
    ("Et|t*4L", "places 5 blocks .* n_layer = 6"),
    ("E|t*6L|t", "has 3 stages but .* = 2 model chunks: use 1 '|' cuts"),
    ("Et||t*5L", "has 3 stages"),
    ("Et|x*5L", "column 4: unknown symbol 'x'"),
    ("Et|(t*5L", "missing '\\)'"),
    ("Et|t*5L)", "'\\)' without a matching '\\('"),
    ("Et|t*L", "'\\*' needs a repeat count"),
    ("  ", "empty layout string"),
])
def test_bad_layouts_say_what_is_wrong(text, match):
    with pytest.raises(LayoutError, match=match):
        layout_bounds(text, 6, 2)
    with pytest.raises(LayoutError, match="stage 1 is empty"):
        layout_bounds("Et*6||L", 6, 3)


def test_preflight_checks_the_layout():
    cfg = load_config(None, {"parallel.pp": 2, "parallel.layout": "Et*2|t*2L",
                             "model.n_layer": 6})
    with pytest.raises(ConfigError, match="parallel.layout: .*places 4 blocks"):
        check_model(cfg)
    cfg = load_config(None, {"parallel.pp": 2, "parallel.layout": "Et|t*5L", "model.n_layer": 6})
    check_model(cfg)
    mlp = load_config(None, {"parallel.layout": "EtL", "model.kind": "mlp"})
    with pytest.raises(ConfigError, match="describes GPT stages"):
        check_model(mlp)


@pytest.mark.mpi
def test_a_heavy_last_stage_trains_and_its_dump_suggests_a_layout(tmp_path):
    """A 2-rank run with a heavy last stage (1 block against 7 plus the head) writes a dump;
    the per-unit costs measured from it cut the model into a balanced layout string. The
    imbalance is 7:1 and the model wide enough that compute, not per-call overhead, dominates,
    so the comparison holds on a loaded machine (1 against 3 at n_embd=32 flipped once in CI)."""
    import sys

    from mpi_util import run_mpi

    from mpipar.analysis.dump import load
    from mpipar.analysis.stage_costs import chunk_times, layout_string, suggest_layout, unit_costs
    from mpipar.datasets import prepare_synthetic

    data = tmp_path / "d.h5"
    prepare_synthetic(data, "pattern", 5000, 256, seed=1)
    out = tmp_path / "run"
    res = run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train", "--data", data, "--out", out,
                      "--pp", "2", "--microbatches", "2", "--steps", "4", "--layout", "Et|t*7L",
                      "--set", "model.n_layer=8", "--set", "model.n_embd=64", "--set",
                      "model.n_head=4", "--set", "model.block_size=16", "--seq-len", "16",
                      "--batch-size", "8", "--set", "train.eval_interval=0", "--quiet"],
                  timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    run = load(str(out / "trace.h5"))
    times = chunk_times(run)
    assert set(times) == {0, 1} and times[1] > times[0] > 0  # the heavy stage takes longer
    costs, symbols = unit_costs(run)
    assert symbols == ["E"] + ["t"] * 8 + ["L"] and all(c > 0 for c in costs)
    text = suggest_layout(run, 2)
    assert layout_bounds(text, 8, 2)  # a valid layout of the same model
    assert text != "Et|t*7L"  # the measured cut moves blocks off the heavy stage
    assert layout_string(symbols, {0: (0, 2), 1: (2, 10)}) == "Et|t*7L"
