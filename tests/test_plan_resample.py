"""``mpipar.plan.resample``: spec samples beside the runs, their median, the nearest, the band."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
from spec_util import spec_text

from mpipar.plan import PlanError
from mpipar.plan.here import planned
from mpipar.plan.measure import _lat_bw
from mpipar.plan.resample import load_samples, overlay, row_bytes, save, spec_set, to_toml

BASE = tomllib.loads(spec_text(intra=(1.0, 5.0)))


def _sample(when, fp32, bw):
    return {"measured_at": when, "peak_tflops": {"fp32": fp32},
            "intra_node": {"bandwidth_gbs": bw, "latency_us": 5.0, "efficiency": 1.0}}


def _mlp(m=4):
    return {"model": {"kind": "mlp", "sizes": [64] * 5},
            "train": {"batch_size": 512, "dtype": "float32"},
            "parallel": {"schedule": "1f1b", "microbatches": m}}


def test_median_nearest_and_band():
    """The median spec holds each sampled key's median and the base's other keys; the nearest
    sample is the one measured closest in time; a slower sample plans a longer step, so the
    band of planned steps holds the median's."""
    samples = [_sample(100.0, 0.04, 2.0), _sample(200.0, 0.05, 1.0), _sample(300.0, 0.02, 3.0)]
    got = overlay(BASE, [{k: v for k, v in s.items() if k != "measured_at"} for s in samples])
    assert got["peak_tflops"]["fp32"] == 0.04 and got["intra_node"]["bandwidth_gbs"] == 2.0
    assert got["hbm"] == BASE["hbm"] and BASE["peak_tflops"]["fp32"] == 0.05  # base unchanged
    specs = spec_set(BASE, samples)
    assert specs.median.peak["fp32"] == pytest.approx(4e10)
    assert specs.nearest(190.0).peak["fp32"] == pytest.approx(5e10)
    assert specs.nearest(1e9).peak["fp32"] == pytest.approx(2e10)
    grid = {"dp": 1, "pp": 2, "tp": 1}
    band = [planned(_mlp(), grid, c)["step"] for _, c in specs.samples]
    mid = planned(_mlp(), grid, specs.median)["step"]
    assert min(band) < mid < max(band) and band[2] == max(band)  # the slowest GEMM
    alone = spec_set(BASE, [])
    assert alone.samples == [] and alone.nearest(0.0) is alone.median


def test_samples_are_stored_and_read_back(tmp_path):
    """Each sample a TOML file of the sampled keys and measured_at; read back in order; a
    file without measured_at or not TOML: one PlanError naming it."""
    one, two = _sample(2.0, 0.04, 2.0), _sample(1.0, 0.03, 1.0)
    save(one, tmp_path, 0)
    save(two, tmp_path, 1)
    assert load_samples(tmp_path) == [one, two]
    assert load_samples(tmp_path / "none") == []
    assert tomllib.loads(to_toml(BASE)) == BASE  # the writer round-trips a whole spec
    (tmp_path / "sample-02.toml").write_text("x = 1\n")
    with pytest.raises(PlanError, match="sample-02.toml.*measured_at"):
        load_samples(tmp_path)
    (tmp_path / "sample-02.toml").write_text("x = \n")
    with pytest.raises(PlanError, match="sample-02.toml.*not valid TOML"):
        load_samples(tmp_path)


def test_row_bytes_are_the_boundary_activation():
    """A micro-batch's stage boundary: tiny GPT (batch 16 / m 4, seq 64, d 64, float32) 64 KiB;
    the MLP (batch 64 / m 2, widest 128) 16 KiB, halved again by dp = 2."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import plan_here

    assert row_bytes(*plan_here.row_config(("tiny", 1, 2, 1, "1f1b", 1, 4, "none"))) == 65536
    assert row_bytes(*plan_here.row_config(("mlp", 1, 2, 1, "1f1b", 1, 2, "none"))) == 16384
    assert row_bytes(*plan_here.row_config(("mlp", 2, 1, 1, "1f1b", 1, 2, "none"))) == 8192


def test_bandwidth_at_the_rows_sizes_is_their_median():
    """measure._lat_bw: the latency the smallest message's time; the bandwidth from the largest
    (the default sizes) or the median over every larger size (the rows' sizes)."""
    rows = np.array([(8, 1e-6), (1000, 2e-6), (3000, 2e-6), (10**6, 1.001e-3)],
                    dtype=[("bytes", "i8"), ("comm_s", "f8")])
    lat, bw = _lat_bw(rows, 1.0)
    assert lat == 1e-6 and bw == pytest.approx(1e9)
    lat, bw = _lat_bw(rows, 2.0, largest=False)
    assert bw == pytest.approx(2 * 1e9)  # median of 1e9, 3e9, 1e9


def test_reduce_bytes_are_the_dp_buckets():
    """The gradient all-reduce sizes of a dp > 1 row: each pipeline rank's parameter bytes, cut
    at bucket_mb (memory_model's count); none with dp = 1."""
    from mpipar.analysis.memory_model import predict_run
    from mpipar.plan.resample import reduce_bytes

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import plan_here

    assert reduce_bytes(*plan_here.row_config(("mlp", 1, 2, 1, "1f1b", 1, 4, "none"))) == []
    cfg, grid = plan_here.row_config(("mlp", 2, 1, 1, "1f1b", 1, 2, "none"))
    assert reduce_bytes(cfg, grid) == [predict_run(cfg, grid)[0]["params"]]
    cfg["train"]["bucket_mb"] = 0.0625
    assert reduce_bytes(cfg, grid) == [65536]


@pytest.mark.slow
def test_drift_probe_reports_each_estimators_spread(tmp_path):
    """experiments/plan_here_drift.py: the reference block's forward taken in one process and
    in fresh ones, each take every estimator, the spread of each per place."""
    import json
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, str(repo / "experiments" / "plan_here_drift.py"),
                           "--times", "2", "--minutes", "0", "--processes", "2", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["where"] for r in doc["rows"]] == ["one process"] * 2 + ["fresh process"] * 2
    for r in doc["rows"]:
        assert 0 < r["min_us"] <= r["median_us"] and r["first_us"] > 0 and r["repeats"] >= 4
    assert doc["meta"]["one process"]["median_us"] >= 0
    bad = subprocess.run([sys.executable, str(repo / "experiments" / "plan_here_drift.py"),
                          "--times", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--times >= 2" in bad.stderr
