"""The OPT region warm or cold by the size of a rank's optimizer state against its core's
cache (``plan.opt_region.opt_warm``), the cache read from sysfs (``plan.measure.core_cache_bytes``),
and ``experiments/plan_here.py --replan``'s dump lookup."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from test_plan_here import SPEC

from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.lowering import lower
from mpipar.plan import load_cluster
from mpipar.plan.here import cost_model, opt_floor, planned
from mpipar.plan.opt_region import _optimizer, opt_state_bytes, opt_warm

UNITS = ("\n[units]\nopt_value_us = 0.004\nopt_tensor_us = 20.0\n"
         "opt_value_warm_us = 0.001\nopt_tensor_warm_us = 5.0\n"
         "\n[executor]\nprobe_opt_us = 100.0\n")


def _spec(tmp_path, cache_mb: float, units: str = UNITS):
    path = tmp_path / f"spec{cache_mb}.toml"
    path.write_text(f"cache_mb = {cache_mb}\n" + SPEC + units)
    return load_cluster(str(path))


def _mlp(width: int, zero1: bool = False):
    return {"model": {"kind": "mlp", "sizes": [width] * 3},
            "train": {"batch_size": 64, "dtype": "float32", "zero1": zero1},
            "parallel": {"schedule": "1f1b", "microbatches": 2}}


def test_state_that_fits_the_core_cache_gets_the_warm_costs(tmp_path):
    """A rank's state (weights, gradients, its share of two moments) within the cache: the
    warm per-value and per-tensor costs; beyond it, or with no cache or no warm costs in the
    spec: the cold ones. The probe (tiny, warm) sets the fixed cost both share."""
    c = _spec(tmp_path, 1.0)
    assert opt_state_bytes(4, 1000, 1) == 16000 and opt_state_bytes(4, 1000, 2) == 12000
    assert opt_warm(c, 4, 60_000) and not opt_warm(c, 4, 70_000)  # 1 MiB / 16 B = 65536
    assert opt_warm(c, 4, 80_000, zero=2)  # ZeRO-1 halves the moments: 12 B a value
    assert not opt_warm(_spec(tmp_path, 0.0), 4, 100)
    cold_only = "\n[units]\nopt_value_us = 0.004\nopt_tensor_us = 20.0\n"
    assert not opt_warm(_spec(tmp_path, 1.0, cold_only), 4, 100)
    assert _optimizer(c, 4, 1e4, 3, warm=True) == pytest.approx(1e4 * 1e-9 + 3 * 5e-6)
    assert _optimizer(c, 4, 1e4, 3) == pytest.approx(1e4 * 4e-9 + 3 * 20e-6)
    # the probe's ranks: two 8 x 8 linears, 144 values in 4 tensors, warm
    assert opt_floor(c) == pytest.approx(100e-6 - (144e-9 + 4 * 5e-6))
    sched = lower(build_schedule("1f1b", 1, 2, virtual_stages=1))
    grid = {"dp": 1, "pp": 1, "tp": 1}
    for width, warm in ((64, True), (256, False)):  # 2 x 64 x 65 values; 2 x 256 x 257
        values, tensors = 2 * width * (width + 1), 4
        got = cost_model(_mlp(width), grid, c, sched, 1).optimizer[0]
        assert got == pytest.approx(_optimizer(c, 4, values, tensors, warm) + opt_floor(c))
        cold = cost_model(_mlp(width), grid, c, sched, 1, warm=False).optimizer[0]
        assert cold == pytest.approx(_optimizer(c, 4, values, tensors) + opt_floor(c))
    small = _mlp(64)
    assert planned(small, grid, c)["step"] < planned(small, grid, c, with_warm=False)["step"]


def test_core_cache_is_the_largest_cache_one_cpu_has_alone(tmp_path):
    """sysfs's cache entries: instruction caches and caches shared with another cpu are not a
    rank's own; sizes in K/M; nothing readable: 0."""
    from mpipar.plan.measure import core_cache_bytes

    for i, (kind, size, shared) in enumerate((("Data", "32K", "0"), ("Instruction", "64K", "0"),
                                              ("Unified", "1024K", "0"),
                                              ("Unified", "32M", "0-1"))):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, text in (("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(text + "\n")
    assert core_cache_bytes(tmp_path) == 2**20
    assert core_cache_bytes(tmp_path / "none") == 0.0


def test_optimizer_costs_cold_and_warm():
    """unit_bench times the OPT region cold, and warm when given the cache size."""
    from mpipar.plan.unit_bench import optimizer_costs

    got = optimizer_costs(0.05, 2**20)  # a median over a few repeats of each timing
    assert set(got) == {"opt_tensor", "opt_value", "opt_tensor_warm", "opt_value_warm"}
    # each cost is solved from two timings and clamped at 0 by unit_bench._solve (its
    # arithmetic: tests/test_plan_measure.py): under load any of them may come out 0
    assert all(0 <= v < 1 for v in got.values())
    assert set(optimizer_costs(0.0)) == {"opt_tensor", "opt_value"}


def test_replan_finds_repeats_or_one_run_and_says_when_neither(tmp_path):
    """plan_here --replan: a row's ``-r<rep>`` dumps, else the one-run layout's; neither: one
    error naming the row and the directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import common
    import plan_here

    row = ("mlp", 1, 1, 1, "1f1b", 1, 2, "none")
    name = plan_here.row_name(row)
    with pytest.raises(common.ExperimentError, match=name):
        plan_here.dumps_of(tmp_path, row, 3)
    (tmp_path / name).mkdir()
    (tmp_path / name / "trace.h5").write_text("")
    assert plan_here.dumps_of(tmp_path, row, 3) == [tmp_path / name / "trace.h5"]
    for rep in (0, 1):
        (tmp_path / f"{name}-r{rep}").mkdir()
        (tmp_path / f"{name}-r{rep}" / "trace.h5").write_text("")
    assert [p.parent.name for p in plan_here.dumps_of(tmp_path, row, 3)] == [
        f"{name}-r0", f"{name}-r1"]


def test_dp_replicas_wait_for_the_slowest(tmp_path):
    """plan.replicas: E[max of n standard normals] (0.5642 for 2, 1.0294 for 4); the step of a
    dp = 2 run grows by e_2 x step_cv x the busiest rank's compute; one replica, or a spec
    without step_cv: nothing."""
    from mpipar.plan.replicas import expected_max, replica_wait

    assert expected_max(1) == 0.0
    assert expected_max(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert expected_max(4) == pytest.approx(1.0294, abs=1e-4)
    path = tmp_path / "cv.toml"
    path.write_text("step_cv = 0.1\n" + SPEC)
    c, bare = load_cluster(str(path)), _spec(tmp_path, 0.0)
    assert replica_wait(c, 1, 1.0) == 0.0 and replica_wait(bare, 4, 1.0) == 0.0
    assert replica_wait(c, 4, 2.0) == pytest.approx(0.2 * expected_max(4))
    grid = {"dp": 2, "pp": 1, "tp": 1}
    got, lone = planned(_mlp(64), grid, c), planned(_mlp(64), grid, c, with_replicas=False)
    assert got["replica_wait"] == pytest.approx(expected_max(2) * 0.1 * max(lone["compute"]))
    assert got["step"] == pytest.approx(lone["step"] + got["replica_wait"])
    one = {"dp": 1, "pp": 1, "tp": 1}
    assert planned(_mlp(64), one, c)["step"] == planned(_mlp(64), one, c,
                                                         with_replicas=False)["step"]


def test_step_cv_from_the_reference_chain():
    """unit_bench.step_cv: std / mean over the reference chain's repeats, >= 0."""
    from mpipar.plan.unit_bench import step_cv

    assert 0 <= step_cv(0.0, least=3) < 1
