"""``mpipar.plan.unit_fit``: a unit's phase from its counted work, fitted over measured shapes."""

from __future__ import annotations

import pytest
from spec_util import spec_text

from mpipar.plan import load_cluster
from mpipar.plan.here import calibration, unit_costs
from mpipar.plan.unit_bench import REF, SHAPES
from mpipar.plan.unit_fit import (
    _gpt_config,
    _parts_by_kind,
    fit_weights,
    phase_parts,
    phase_times,
)

SPEC = spec_text(intra=(1e9, 0.001), inter=(1.0, 50.0))
KINDS = ("embed", "block", "head")


def _cluster(tmp_path, units: dict):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC + "\n[units]\n" + "".join(f"{k}_us = {v!r}\n" for k, v in units.items()))
    return load_cluster(str(path))


def _shape_times(c, weights: dict, floor: float, scale: float = 1.0) -> dict:
    """Times of every GPT unit and phase at REF and SHAPES made by known weights (a, c, k)."""
    out = {}
    for i, shape in [("ref", REF["gpt"])] + [(f"shape{j}", s) for j, s in enumerate(SHAPES, 1)]:
        parts = _parts_by_kind(_gpt_config(*shape), c, unit_costs)
        for kind in KINDS:
            for ph, (g, h, m) in phase_parts(parts[kind]).items():
                a, cc, k = weights[ph]
                out[f"{i}_{kind}_{ph}"] = 1e6 * (floor + a * g + cc * h + k * m) * (
                    1.0 if i == "ref" else scale)
    return out


def test_one_row_keeps_the_single_shape_rule():
    """Only the reference shape: the GEMMs at the curve (a = c = 1), k solves that shape."""
    assert fit_weights([(2.0, 1.0, 4.0, 15.0)], 1.0) == pytest.approx((1.0, 1.0, 2.75))
    assert fit_weights([(2.0, 1.0, 4.0, 3.0)], 1.0) == (1.0, 1.0, 0.0)  # never negative


def test_weights_are_recovered_from_the_shapes(tmp_path):
    """Times made by known weights at every shape: the fit finds them, and a unit of another
    shape (the tiny GPT's) is priced as those weights price it; the single-shape rule does not."""
    weights = {"f": (1.1, 1.8, 1.2), "b": (1.5, 1.6, 0.4), "w": (1.3, 0.0, 0.3)}
    floor = 50e-6
    probe = _cluster(tmp_path, {"ref_block_f": 1.0})
    times = _shape_times(probe, weights, floor)
    units = {f"floor_{k}_{p}": floor * 1e6 for k in KINDS for p in "fbw"}
    units |= times | {f"shape0_{k.removeprefix('ref_')}": v for k, v in times.items()
                      if k.startswith("ref_")}
    c = _cluster(tmp_path, units)
    cal = calibration(c)
    for ph, w in weights.items():
        assert cal[("block", ph)][1] == pytest.approx(w, rel=1e-6, abs=1e-9)
    tiny = _parts_by_kind(_gpt_config(64, 4, 64, 4), c, unit_costs)["block"]
    want = [floor + sum(x * y for x, y in zip(weights[p], phase_parts(tiny)[p], strict=True))
            for p in "fbw"]
    assert phase_times(tiny, cal, "none") == pytest.approx(want, rel=1e-6)
    one = _cluster(tmp_path, {k: v for k, v in units.items() if not k.startswith("shape")})
    assert phase_times(tiny, calibration(one), "none")[1] != pytest.approx(want[1], rel=0.01)


def test_shapes_take_their_level_from_the_reference(tmp_path):
    """Shapes timed when the machine ran 30 % slower (their own floor and reference 30 % above
    floor_ and ref_): scaled to ref_'s level, the same weights come out."""
    weights = {"f": (1.1, 1.8, 1.2), "b": (1.5, 1.6, 0.4), "w": (1.3, 0.0, 0.3)}
    floor = 50e-6
    probe = _cluster(tmp_path, {"ref_block_f": 1.0})
    times = _shape_times(probe, weights, floor, scale=1.3)
    units = {f"floor_{k}_{p}": floor * 1e6 for k in KINDS for p in "fbw"} | times
    units |= {f"shapefloor_{k}_{p}": 1.3 * floor * 1e6 for k in KINDS for p in "fbw"}
    units |= {f"shape0_{k.removeprefix('ref_')}": 1.3 * v for k, v in times.items()
              if k.startswith("ref_")}
    cal = calibration(_cluster(tmp_path, units))
    for ph, w in weights.items():
        assert cal[("block", ph)][1] == pytest.approx(w, rel=1e-6, abs=1e-9)


@pytest.mark.slow  # every chain of plan measure, at a minimal budget: seconds
def test_unit_times_hold_every_shape():
    """``unit_times`` writes the floor, the reference and each of SHAPES (with the reference
    again as shape0) for every GPT unit and phase (minimal budget)."""
    from mpipar.plan.unit_bench import unit_times

    got = unit_times(0.0)
    for i in ["floor"] + list(range(len(SHAPES) + 1)):
        assert all(f"shape{i}_{k}_{p}" in got for k in KINDS for p in "fbw")
    assert "ref_linear_f" in got and "floor_loss_f" in got


def test_the_plan_uses_the_shapes_only_when_asked(tmp_path):
    """``planned`` prices by the reference shape alone (the spec's shapes ignored) unless
    ``with_shapes``; with them (a GEMM weight of 2 at every shape) the step changes."""
    from mpipar.plan.here import planned
    from mpipar.plan.unit_fit import one_shape

    weights = {"f": (2.0, 1.0, 1.0), "b": (2.0, 1.0, 1.0), "w": (2.0, 0.0, 1.0)}
    floor = 50e-6
    probe = _cluster(tmp_path, {"ref_block_f": 1.0})
    times = _shape_times(probe, weights, floor)
    units = {f"floor_{k}_{p}": floor * 1e6 for k in KINDS for p in "fbw"} | times
    units |= {f"shape0_{k.removeprefix('ref_')}": v for k, v in times.items()
              if k.startswith("ref_")}
    c = _cluster(tmp_path, units)
    cfg = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 64, "n_layer": 2,
                     "n_embd": 64, "n_head": 4},
           "train": {"batch_size": 8, "seq_len": 64, "dtype": "float32"},
           "parallel": {"schedule": "1f1b", "microbatches": 2}}
    grid = {"dp": 1, "pp": 1, "tp": 1}
    assert planned(cfg, grid, c)["step"] == planned(cfg, grid, one_shape(c))["step"]
    assert planned(cfg, grid, c, with_shapes=True)["step"] != pytest.approx(
        planned(cfg, grid, c)["step"], rel=1e-3)


@pytest.mark.slow  # a subprocess timing every chain: seconds
def test_plan_here_shapes_runs_and_writes_every_unit_and_phase(tmp_path):
    """experiments/plan_here_shapes.py at a minimal budget: a row per model, unit and phase,
    each with the plan's and the fit's price; a missing spec is one clear line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    env = dict(os.environ, PYTHONPATH=str(repo))
    script = str(repo / "experiments" / "plan_here_shapes.py")
    done = subprocess.run([sys.executable, script, "--spec", str(spec), "--out",
                           str(tmp_path / "out"), "--rounds", "1", "--budget", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert {(r["model"], r["unit"], r["phase"]) for r in rows} == {
        (m, u, p) for m in ("tiny", "gpt8") for u in KINDS for p in "fbw"}
    assert all(r["measured_us"] > 0 and r["planned_us"] > 0 and r["shapes_us"] > 0
               for r in rows if r["unit"] != "embed")
    bad = subprocess.run([sys.executable, script, "--spec", str(tmp_path / "none.toml")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "plan_here_shapes:" in bad.stderr
