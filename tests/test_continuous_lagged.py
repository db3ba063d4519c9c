"""Continuous PipeDream with its loss and stop agreement read late (``training.lagged``): the
same losses as one reduction per step, metrics.json and the progress line say the lag, and a
stop signal on one rank still ends every rank at one drain point with an exact checkpoint."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import MPI_DIR, SMALL_GPT, run_mpi

from mpipar.training.lagged import LAG, LaggedReductions
from mpipar.training.signals import STOP_SIGNALS, StopSignals


class _World:
    size = 1


def test_reductions_are_read_lag_steps_late_and_all_at_a_drain():
    red = LaggedReductions(_World(), lag=2)
    due = []
    for k in range(5):
        red.post(k, [float(k), 0.0])
        due.append([s for s, _ in red.ready(drain=k == 4)])
    assert due == [[], [], [0], [1], [2, 3, 4]]
    assert not red.posted


def test_the_summed_stop_counts_agree_on_the_largest_signal():
    s = StopSignals()
    assert s.shares() == [0.0] * len(STOP_SIGNALS) and s.agree_from(s.shares()) == 0
    assert not s.stopping
    s.received = int(max(STOP_SIGNALS))
    counts = np.array(s.shares()) + np.array([1.0 if x == min(STOP_SIGNALS) else 0.0
                                              for x in STOP_SIGNALS])
    assert s.agree_from(counts) == int(max(STOP_SIGNALS)) and s.stopping


def _train(tokens, out, *extra):
    return ["--data", tokens, "--out", str(out), *SMALL_GPT, "--dtype", "float64",
            "--pp", "2", "--microbatches", "2", "--schedule", "pipedream-2bw",
            "--set", "parallel.continuous=true", "--set", "run.checkpoint_interval=4",
            "--set", "run.flush_interval=2", "--steps", "12", "--resume", "auto", *extra]


@pytest.mark.mpi
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stop_on_one_rank_ends_at_the_next_drain_and_resumes_exactly(tokens, tmp_path, rank):
    """SIGUSR1 on one rank during step 5: no rank meets the others per step, yet all stop after
    step 8 (the next drain point: checkpoint_interval 4), and the resumed run ends bitwise
    where an uninterrupted one does."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    cli = [sys.executable, "-m", "mpipar.cli", "train"]
    res = run_mpi(2, [*cli, *_train(tokens, whole)], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_mpi(2, [sys.executable, MPI_DIR / "fault_inject.py", "usr1", rank, 5,
                      *_train(tokens, cut)], timeout=240)
    assert res.returncode == 75, res.stderr[-3000:]
    assert "stopped after step 8" in res.stdout and "[mpipar] rank" not in res.stderr
    assert (cut / "checkpoints/latest").read_text().strip() == "step_000008.h5"
    res = run_mpi(2, [*cli, *_train(tokens, cut)], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads(Path(whole / "metrics.json").read_text())
    b = json.loads(Path(cut / "metrics.json").read_text())
    assert a["losses"] == b["losses"] and len(a["losses"]) == 12
    assert a["metrics_lag_steps"] == b["metrics_lag_steps"] == LAG
    from mpipar.analysis import load

    metrics = load(cut / "trace.h5").metrics  # every step's metrics row once, in order
    assert list(metrics["step"]) == list(range(12))


@pytest.mark.mpi
def test_the_progress_line_says_the_lag(tokens, tmp_path):
    args = [a for a in _train(tokens, tmp_path / "run") if a != "--quiet"]
    res = run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train", *args], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 12/12 loss" in res.stdout and f"read up to {LAG} steps late" in res.stdout
