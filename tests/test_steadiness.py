"""``mpipar.plan.steadiness``: the summary of windows read right from synthetic series (a steady
machine, one that switches between two speeds), a real short sample, and ``mpipar bench
--steadiness`` end to end (no timing assertions on the real machine)."""

from __future__ import annotations

import math
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpipar.plan import steadiness

PERIOD = 0.02


def series(levels, noise=0.01, kinds=3, seed=0):
    """Windows at relative speeds ``levels`` (one per window), the kinds in turn, each kind at
    its own scale (the summary must divide it out)."""
    rng = np.random.default_rng(seed)
    n = len(levels)
    kind = np.arange(n) % kinds
    scale = np.array([1e-4, 3e-5, 2e-6])[kind]
    t = scale * np.asarray(levels) * np.exp(rng.normal(0.0, noise, n))
    return {"start": np.arange(n) * PERIOD, "time": t, "kind": kind,
            "kinds": ["a", "b", "c"][:kinds]}


def test_relative_divides_out_each_kinds_scale():
    got = series([1.0] * 300, noise=0.0)
    assert np.allclose(steadiness.relative(got), 1.0)


def test_a_steady_machine_has_one_level_and_every_run_within_the_bound():
    s = steadiness.summary(series([1.0] * 1000))
    assert s["spread"] < 1.05 and s["slow_over_fast"] == 1.0 and s["slow_share"] == 0.0
    assert [r["run_s"] for r in s["runs"]] == [0.5, 2.0, 5.0]
    for r in s["runs"]:
        assert r["within"] == r["within_median"] == 1.0 and r["cv"] < 0.01 and r["pairs"] == 1


def test_two_speeds_are_found_with_their_share_and_dwell():
    """Blocks of 25 windows (0.5 s) at 1.0 and at 1.5 in turn, 3 : 1."""
    levels = ([1.0] * 75 + [1.5] * 25) * 10
    s = steadiness.summary(series(levels))
    assert s["slow_over_fast"] == pytest.approx(1.5, rel=0.02)
    assert s["slow_share"] == pytest.approx(0.25, abs=0.01)
    assert s["dwell_s"] == pytest.approx(len(levels) * PERIOD / 20, rel=0.1)  # 20 blocks
    half = s["runs"][0]  # 0.5 s runs: a quarter of them land on the slow level
    assert half["run_s"] == 0.5 and half["within"] < 0.8
    # the median of three such runs lands on the fast level more often than one run does
    assert half["within_median"] > half["within"]
    for r in s["runs"]:
        assert r["pairs"] == math.ceil(2 * (1.96 * r["cv"] / steadiness.EFFECT) ** 2)
    # longer runs average the levels out: their spread shrinks
    assert s["runs"][-1]["cv"] < half["cv"]


def test_runs_longer_than_the_series_are_left_out():
    s = steadiness.summary(series([1.0] * 60))  # 1.2 s
    assert [r["run_s"] for r in s["runs"]] == [0.5]
    text = "\n".join(steadiness.lines(s))
    assert "one level" in text and "within 10 %" in text


def test_a_real_short_sample_cycles_through_its_kinds():
    got = steadiness.sample(0.15, window=0.005)
    n = len(got["time"])
    assert n >= 2 * len(got["kinds"]) and (got["time"] > 0).all()
    assert list(got["kind"][:3]) == [0, 1, 2] and np.all(np.diff(got["start"]) > 0)
    with pytest.raises(ValueError, match="must be > 0"):
        steadiness.sample(0.0)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mpipar.cli", "bench", *args],
                          capture_output=True, text=True, timeout=120)


def test_bench_steadiness_prints_the_table_and_writes_the_windows(tmp_path):
    out = tmp_path / "steady.h5"
    done = run_cli("--steadiness", "--seconds", "0.6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "machine steadiness" in done.stdout and "spread p90/p10" in done.stdout
    with h5py.File(out) as f:
        g = f["steadiness"]
        assert g["time"].shape == g["start"].shape == g["kind"].shape
        assert "spread" in g.attrs["summary"]


def test_bench_steadiness_refuses_bad_input(tmp_path):
    done = run_cli("--steadiness", "--seconds", "0")
    assert done.returncode == 2 and "--seconds must be > 0" in done.stderr
    done = run_cli("--steadiness", "--quick", "--out", str(tmp_path / "no" / "dir" / "x.h5"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert not (tmp_path / "no").exists()


def test_a_sample_that_overruns_its_time_says_so():
    from mpipar.plan import PlanError

    with pytest.raises(PlanError, match="took over"):
        steadiness.sample_one_thread(30.0, timeout=0.5)


def test_experiments_refuse_a_negative_sample_time(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "experiments" / "plan_here.py"), "--spec",
                           "dgx-h100", "--steadiness", "-1", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--steadiness -1.0: give seconds >= 0" in done.stderr
    done = subprocess.run([sys.executable, str(root / "experiments" / "lean_bench.py"),
                           "--steadiness", "-1", "--out", str(tmp_path / "l")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "give seconds >= 0" in done.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "l").exists()
