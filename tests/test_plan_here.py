"""``mpipar.plan.here``: a run planned from a cluster spec, through the calibrated path's model."""

from __future__ import annotations

import math

import pytest
from spec_util import spec_text

from mpipar.analysis.memory_model import chunk_bounds, predict_run
from mpipar.parallel.pipeline.formulas import textbook_bubble
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.lowering import lower
from mpipar.plan import PlanError, load_cluster
from mpipar.plan.here import calibration, phase_times, planned, unit_costs

SPEC = spec_text(intra=(1e9, 0.001), inter=(1.0, 50.0))


def _cluster(tmp_path, extra=""):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC + extra)
    return load_cluster(str(path))


def _mlp(schedule="1f1b", m=4, **par):
    return {"model": {"kind": "mlp", "sizes": [64] * 5},
            "train": {"batch_size": 512, "dtype": "float32"},
            "parallel": {"schedule": schedule, "microbatches": m, **par}}


def test_equal_stages_give_the_closed_form_bubble(tmp_path):
    """An MLP of equal layers over pp = 2, no executor costs: the planned pipeline bubble is the
    textbook (p-1)/(m+p-1) (to the 1e-9 s p2p latency), from the same simulator the calibrated
    column runs."""
    got = planned(_mlp(), {"dp": 1, "pp": 2, "tp": 1}, _cluster(tmp_path))
    assert got["bubble"] == pytest.approx(textbook_bubble("1f1b", 2, 4), abs=1e-5)
    assert len(got["compute"]) == 2 and got["compute"][0] == pytest.approx(got["compute"][1])
    assert got["step"] > 0


def test_planned_memory_is_the_memory_model_with_trace_and_runtime(tmp_path):
    """The shared memory model, its trace part from the planned events per step, plus the
    spec's runtime_mb on every rank (none in a spec without it)."""
    from mpipar.plan.memory_terms import trace_events

    cfg, grid = _mlp("gpipe", 4), {"dp": 2, "pp": 2, "tp": 1}
    sched = lower(build_schedule("gpipe", 2, 4))
    events = trace_events(cfg, grid, sched, chunk_bounds(cfg, grid, 1),
                          unit_costs(cfg, grid, _cluster(tmp_path)))
    model = [r["total"] for r in predict_run(cfg, grid, events)]
    assert model != [r["total"] for r in predict_run(cfg, grid)]  # the trace part counts
    assert planned(cfg, grid, _cluster(tmp_path))["memory"] == model
    spec = tmp_path / "runtime.toml"
    spec.write_text("runtime_mb = 1.0\n" + SPEC)  # a top-level key: before the tables
    got = planned(cfg, grid, load_cluster(str(spec)))
    assert got["memory"] == [t + 2**20 for t in model]
    assert all(r["runtime"] == 2**20 for r in got["memory_parts"])


def test_trace_events_count_what_the_tracer_records():
    """Per rank and step, as a dump of the probe (MLP, pp = 2, 1F1B, m = 4) records them:
    F, B, pp.send, pp.recv, two pp.wait per receive, LOSS on the last stage, the gradient
    norm, OPT, STEP, mem.peak (counted in such dumps: 28 and 32); dp adds two per bucket."""
    from mpipar.plan.measure import PROBE
    from mpipar.plan.memory_terms import trace_events

    c = load_cluster("dgx-a100-80gb")
    for grid, sched, want in (({"dp": 1, "pp": 2, "tp": 1}, ("1f1b", 2), [28, 32]),
                              ({"dp": 2, "pp": 1, "tp": 1}, ("1f1b", 1), [18])):
        low = lower(build_schedule(sched[0], sched[1], 4))
        got = trace_events(PROBE, grid, low, chunk_bounds(PROBE, grid, 1),
                           unit_costs(PROBE, grid, c))
        assert got == want


def test_recomputation_and_dp_cost_more(tmp_path):
    gpt = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 32, "n_layer": 2,
                     "n_embd": 32, "n_head": 2},
           "train": {"batch_size": 8, "seq_len": 32, "dtype": "float32"},
           "parallel": {"schedule": "1f1b", "microbatches": 2}}
    c = _cluster(tmp_path)
    base = planned(gpt, {"dp": 1, "pp": 1, "tp": 1}, c)
    full = planned({**gpt, "parallel": {**gpt["parallel"], "recompute": "full"}},
                   {"dp": 1, "pp": 1, "tp": 1}, c)
    assert full["compute"][0] > base["compute"][0]
    two = planned(gpt, {"dp": 2, "pp": 1, "tp": 1}, c)
    assert two["comm"][0] > base["comm"][0]  # the gradient all-reduce


def test_unit_calibration_reproduces_the_reference(tmp_path):
    """A [units] section: the reference shape's phases come out as written there."""
    from mpipar.plan.unit_bench import REF

    width, rows = REF["mlp"]
    extra = ("\n[units]\nfloor_linear_f_us = 5.0\nfloor_linear_b_us = 6.0\n"
             "floor_linear_w_us = 4.0\nref_linear_f_us = 900.0\n"
             "ref_linear_b_us = 1500.0\nref_linear_w_us = 700.0\n")
    c = _cluster(tmp_path, extra)
    cal = calibration(c)
    cfg = {"model": {"kind": "mlp", "sizes": [width] * 3},
           "train": {"batch_size": rows, "dtype": "float32"}}
    u = unit_costs(cfg, {"dp": 1, "pp": 1, "tp": 1}, c)[0]
    f, b, w = phase_times(u, cal, "none")
    assert (f, b, w) == pytest.approx((900e-6, 1500e-6, 700e-6), rel=1e-9)


def test_continuous_is_refused_with_a_reason(tmp_path):
    cfg = _mlp()
    cfg["parallel"]["continuous"] = True
    with pytest.raises(PlanError, match="continuous"):
        planned(cfg, {"dp": 1, "pp": 2, "tp": 1}, _cluster(tmp_path))


def test_analyze_prints_measured_calibrated_and_planned(tmp_path, capsys, monkeypatch):
    """``mpipar analyze --spec``: the three columns side by side; without a spec, a line
    saying how to make one; a spec that is not there: one error line, exit 2."""
    from mpipar.analysis.synthetic_run import write_run
    from mpipar.cli import main

    path = tmp_path / "syn.h5"
    write_run(path, dp=1, pp=2, tp=1, steps=4, schedule="1f1b", microbatches=4)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    monkeypatch.delenv("MPIPAR_SPEC", raising=False)
    assert main(["analyze", str(path), "--spec", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "measured | calibrated | planned" in out
    for row in ("step time (ms)", "bubble (pipeline window)", "pp1 compute", "pp0 communication",
                "pp1 peak memory"):
        assert row in out
    assert main(["analyze", str(path)]) == 0
    assert "planned: no machine spec (mpipar plan measure" in capsys.readouterr().out
    assert main(["analyze", str(path), "--spec", str(tmp_path / "none.toml")]) == 2
    assert "neither a bundled spec nor a file" in capsys.readouterr().err


def test_ranks_beyond_the_cores_share_them(tmp_path):
    """cores_per_node = 2: four ranks on a node each get half a core (every CPU cost doubles);
    two ranks get a whole one; spread over two nodes, four ranks do too."""
    import dataclasses

    c = _cluster(tmp_path)
    shared = dataclasses.replace(c, cores_per_node=2)
    cfg, grid = _mlp(), {"dp": 2, "pp": 2, "tp": 1}
    alone = planned(cfg, grid, c)
    four = planned(cfg, grid, shared)
    assert four["compute"] == pytest.approx([2 * x for x in alone["compute"]])
    assert planned(cfg, grid, shared, ranks_per_node=2)["compute"] == pytest.approx(
        alone["compute"])


def test_action_floor_is_what_the_probe_took_beyond_the_units(tmp_path):
    """[executor] probe_f_us / probe_b_us: the floor is the probe's measured mean less this
    model's mean for the probe run; it adds to every chunk's F; none without the probe."""
    from mpipar.plan.here import action_floor

    plain = _cluster(tmp_path)
    assert action_floor(plain) == (0.0, 0.0)
    c = _cluster(tmp_path, "\n[executor]\nprobe_f_us = 5000.0\nprobe_b_us = 9000.0\n")
    f, b = action_floor(c)
    assert 0 < f < 5e-3 and 0 < b < 9e-3
    cfg, grid = _mlp(), {"dp": 1, "pp": 2, "tp": 1}
    bare = planned(cfg, grid, c, with_floor=False)
    got = planned(cfg, grid, c)
    assert got["compute"][0] == pytest.approx(bare["compute"][0] + 4 * (f + b))  # m = 4


def test_tensor_count_is_the_built_models():
    """The optimizer's per-tensor term counts the tensors mpipar builds, unit by unit."""
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model
    from mpipar.models.spec import GPTDims, gpt_units
    from mpipar.plan.here import _tensors

    for tied in ("false", "true"):
        cfg = load_config(None, {"model.kind": "gpt", "model.vocab_size": "16",
                                 "model.block_size": "8", "model.n_layer": "2",
                                 "model.n_embd": "8", "model.n_head": "2",
                                 "model.tie_embeddings": tied, "train.seq_len": "8"})
        model = build_model(cfg.model, Backend("cpu", "float32"))
        units = gpt_units(GPTDims.of(vars(cfg.model)))
        assert [_tensors(u) for u in units] == [len(u.params()) for u in model.units]


def test_mlp_loss_adds_to_its_last_unit_only(tmp_path):
    """[units] floor_loss_*: the MLP's loss (a LOSS region of its own) adds its measured
    per-call time to the last unit's F and B, not W, nor any other unit."""
    extra = "\n[units]\nfloor_loss_f_us = 30.0\nfloor_loss_b_us = 8.0\n"
    bare, c = _cluster(tmp_path), _cluster(tmp_path, extra)
    units = unit_costs(_mlp(), {"dp": 1, "pp": 1, "tp": 1}, c)
    assert [u["loss"] for u in units] == [False, False, False, True]
    for u in units:
        want = phase_times(u, calibration(bare), "none")
        add = (30e-6, 8e-6, 0.0) if u["loss"] else (0.0, 0.0, 0.0)
        got = phase_times(u, calibration(c), "none")
        assert got == pytest.approx(tuple(x + y for x, y in zip(want, add, strict=True)))


def test_optimizer_per_value_per_tensor_and_probe_floor(tmp_path):
    """[units] opt_value_us replaces the counted traffic; opt_tensor_us adds per tensor;
    [executor] probe_opt_us adds what the probe's OPT took beyond both, on every rank."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.plan.here import _optimizer, cost_model, opt_floor

    units = "\n[units]\nopt_value_us = 0.002\nopt_tensor_us = 10.0\n"
    c = _cluster(tmp_path, units)
    assert _optimizer(c, 4, 1e6, 3) == pytest.approx(2e-3 + 30e-6)
    assert _optimizer(c, 8, 1e6, 3) == pytest.approx(4e-3 + 30e-6)  # fp64: twice the bytes
    assert opt_floor(c) == 0.0
    probe = _cluster(tmp_path, "\n[executor]\nprobe_opt_us = 500.0\n" + units)
    # the probe's ranks each hold two 8 x 8 linears (4 tensors, 144 values)
    assert opt_floor(probe) == pytest.approx(500e-6 - (144 * 0.002e-6 + 4 * 10e-6))
    sched = lower(build_schedule("1f1b", 2, 4, virtual_stages=1))
    grid = {"dp": 1, "pp": 2, "tp": 1}
    a, b = cost_model(_mlp(), grid, c, sched, 1), cost_model(_mlp(), grid, probe, sched, 1)
    for p in (0, 1):
        assert b.optimizer[p] == pytest.approx(a.optimizer[p] + opt_floor(probe))


def test_collectives_of_ranks_sharing_cores_wait_for_their_partners(tmp_path):
    """plan.sharing: the chance that all partners run beside a running member, C(R-g, C-g) /
    C(R-1, C-1); each collective call would wait (1 - it) x half a slice; none with a core per
    rank. Shown beside the plan, not in it (MPICH's waits yield: the time sharing has charged
    the wait): a tp = 2 x dp = 2 run on 2 cores with ``with_cosched`` grows by every tp call's
    wait (the blocks', the embedding's, the head's, the loss's), the buckets' and the norm's."""
    import dataclasses

    from mpipar.plan.sharing import cosched_wait

    c = _cluster(tmp_path, "\n[executor]\nsched_slice_us = 1000.0\n")
    two = dataclasses.replace(c, cores_per_node=2)
    assert cosched_wait(two, 2, 2) == 0.0 and cosched_wait(c, 4, 2) == 0.0
    assert cosched_wait(two, 4, 2) == pytest.approx((1 - 1 / 3) * 500e-6)
    assert cosched_wait(two, 4, 4) == pytest.approx(500e-6)  # never all four at once
    assert cosched_wait(dataclasses.replace(c, cores_per_node=3), 4, 2) == pytest.approx(
        (1 - 2 / 3) * 500e-6)
    gpt = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 32, "n_layer": 2,
                     "n_embd": 32, "n_head": 2},
           "train": {"batch_size": 8, "seq_len": 32, "dtype": "float32"},
           "parallel": {"schedule": "1f1b", "microbatches": 2}}
    grid = {"dp": 2, "pp": 1, "tp": 2}
    spun = planned(gpt, grid, two, with_cosched=True)
    shared = planned(gpt, grid, two)
    alone = planned(gpt, grid, two, with_share=False)
    # per micro-batch: 2 blocks x (2 in F + 2 in B), the embedding's 1, the head's 1 and the
    # loss's 3 tp calls; 2 micro-batches; 1 bucket; the norm's all-reduce
    waits = ((2 * 4 + 5) * 2 + 1) * cosched_wait(two, 4, 2) + cosched_wait(two, 4, 4)
    assert spun["step"] - shared["step"] == pytest.approx(waits, rel=1e-6)
    assert shared["step"] > 1.9 * alone["step"]  # the time sharing: half a core each


def test_shared_slowdown_divides_the_share_of_ranks_beyond_the_cores(tmp_path):
    """plan.oversub's measured factor: with more ranks than cores every CPU cost grows by it
    on top of the time sharing; with a core per rank it changes nothing; a spec without it
    reads as 1 (and a factor below 1 as 1: a share is never more than the cores give)."""
    import dataclasses

    from mpipar.plan.sharing import core_share

    c = dataclasses.replace(_cluster(tmp_path, ""), cores_per_node=2)
    assert c.shared_slowdown == 1.0
    slow = dataclasses.replace(c, shared_slowdown=1.25)
    assert core_share(slow, 4) == pytest.approx(0.5 / 1.25)
    assert core_share(slow, 4, slowdown=False) == core_share(c, 4) == 0.5
    assert core_share(slow, 2) == 1.0
    gpt = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 32, "n_layer": 2,
                     "n_embd": 32, "n_head": 2},
           "train": {"batch_size": 8, "seq_len": 32, "dtype": "float32"},
           "parallel": {"schedule": "1f1b", "microbatches": 2}}
    four, two = {"dp": 4, "pp": 1, "tp": 1}, {"dp": 2, "pp": 1, "tp": 1}
    got, bare = planned(gpt, four, slow), planned(gpt, four, slow, with_slowdown=False)
    assert bare["step"] == pytest.approx(planned(gpt, four, c)["step"])
    assert max(got["compute"]) == pytest.approx(1.25 * max(bare["compute"]), rel=1e-6)
    assert planned(gpt, two, slow)["step"] == pytest.approx(planned(gpt, two, c)["step"])
    path = tmp_path / "slow.toml"
    path.write_text("shared_slowdown = 0.8\n" + SPEC)
    assert load_cluster(str(path)).shared_slowdown == 1.0


def test_tp_all_reduces_outside_the_blocks():
    """The vocab-parallel embedding all-reduces in F, the head in B (its input gradient), the
    loss three times in F (T values each); the blocks twice in F and twice in B (T d values);
    none on one tp rank, none outside the blocks with ``outside_tp`` False."""
    c = load_cluster("dgx-a100-80gb")
    gpt = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 32, "n_layer": 2,
                     "n_embd": 32, "n_head": 2},
           "train": {"batch_size": 8, "seq_len": 32, "dtype": "float32"},
           "parallel": {"schedule": "1f1b", "microbatches": 2}}
    two = {"dp": 1, "pp": 1, "tp": 2}
    units = unit_costs(gpt, two, c)
    assert [u["tp_calls"] for u in units] == [(1, 0), (2, 2), (2, 2), (3, 1)]
    embed, block, head = units[0], units[1], units[-1]
    assert embed["tp_f"] == pytest.approx(block["tp_f"] / 2) and embed["tp_b"] == 0.0
    # three all-reduces of T values: each no dearer than one of T d
    assert head["tp_b"] == pytest.approx(block["tp_b"] / 2) and 0 < head["tp_f"] < 3 * embed["tp_f"]
    bare = unit_costs(gpt, two, c, outside_tp=False)
    assert [u["tp_calls"] for u in bare] == [(0, 0), (2, 2), (2, 2), (0, 0)]
    assert all(u["tp_calls"] == (0, 0) and u["tp_f"] == u["tp_b"] == 0.0
               for u in unit_costs(gpt, {"dp": 1, "pp": 1, "tp": 1}, c))
    assert planned(gpt, two, c)["step"] > planned(gpt, two, c, with_outside_tp=False)["step"]


@pytest.mark.slow
@pytest.mark.mpi
def test_plan_here_quick_repeats_rows_and_reports_medians(tmp_path):
    """experiments/plan_here.py --quick --repeats 2: every distinct row run twice (a layout in
    both tables once per repeat), the median step and its spread, every added term a column;
    three spec samples (before each round, after the last), planned from their median, the
    nearest, and the band; --replan plans the same from the stored dumps and samples."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = tmp_path / "spec.toml"
    spec.write_text("cores_per_node = 2\n" + SPEC)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(repo / "experiments" / "plan_here.py"),
                           "--quick", "--repeats", "2", "--spec", str(spec), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    runs = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()
                  and p.name != "specs")
    assert len(runs) == 2 * 5 and all(r.endswith(("-r0", "-r1")) for r in runs)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(doc["rows"]) == 3 + 3 and doc["meta"]["repeats"] == 2
    for r in doc["rows"]:
        assert r["step_ms"] > 0 and r["spread_pct"] >= 0 and r["planned_ms"] > 0
        assert r["no_share_ms"] <= r["planned_ms"] <= r["slice_wait_ms"] + 1e-9
        assert r["blocks_tp_ms"] <= r["planned_ms"] + 1e-9
        assert r["trace_mib"] > 0 and r["runtime_mib"] == 0  # the spec has no runtime_mb
        # planned from the median of the samples, the nearest one, and the band of them all
        assert r["band_lo_ms"] <= r["near_ms"] <= r["band_hi_ms"]
        assert r["in_band"] == (r["band_lo_ms"] <= r["step_ms"] <= r["band_hi_ms"])
    # a spec sample before each round and after the last, stored for --replan
    assert len(doc["meta"]["samples"]) == 3
    # the machine's steadiness before the rows and after them (plan.steadiness)
    steady = doc["meta"]["steadiness"]
    assert set(steady) == {"before", "after"} and steady["before"]["spread"] >= 1.0
    assert "before the rows:" in proc.stdout and "machine steadiness" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "specs").iterdir()) == [
        "sample-00.toml", "sample-01.toml", "sample-02.toml"]
    again = subprocess.run([sys.executable, str(repo / "experiments" / "plan_here.py"),
                            "--quick", "--repeats", "2", "--spec", str(spec), "--replan",
                            str(tmp_path / "out"), "--out", str(tmp_path / "again")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    redo = json.loads((tmp_path / "again" / "results.json").read_text())
    assert [r["planned_ms"] for r in redo["rows"]] == [r["planned_ms"] for r in doc["rows"]]
    assert len(redo["meta"]["samples"]) == 3 and "3 spec samples" in again.stdout
    assert "steadiness" not in redo["meta"]  # nothing run: no machine to sample


def test_run_seconds_sizes_each_row_by_its_plan(tmp_path):
    """plan_here --run-seconds T: a row runs about T seconds of steps by the spec's plan (the
    fewer the planned step's milliseconds, the more steps), never fewer than --steps, at most
    MAX_STEPS; without it, --steps alone."""
    import sys
    import types
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import plan_here

    spec = tmp_path / "spec.toml"
    spec.write_text("cores_per_node = 2\n" + SPEC)
    tiny, gpt8 = ("tiny", 1, 2, 1, "1f1b", 1, 4, "none"), ("gpt8", 1, 2, 1, "1f1b", 1, 4, "none")
    plain = types.SimpleNamespace(steps=None, quick=False, run_seconds=None, spec=str(spec))
    assert plan_here.steps_of(plain, tiny) == plan_here.STEPS
    sized = types.SimpleNamespace(steps=None, quick=False, run_seconds=2.0, spec=str(spec))
    n_tiny, n_gpt8 = plan_here.steps_of(sized, tiny), plan_here.steps_of(sized, gpt8)
    assert plan_here.STEPS <= n_gpt8 < n_tiny <= plan_here.MAX_STEPS
    for row, n in ((tiny, n_tiny), (gpt8, n_gpt8)):
        step = planned(*plan_here.row_config(row), load_cluster(str(spec)))["step"]
        assert n == max(plan_here.STEPS, min(plan_here.MAX_STEPS, math.ceil(2.0 / step) + 1))
