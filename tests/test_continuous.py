"""Continuous PipeDream and PipeDream-2BW: no flush between steps (schedules, checker,
simulator, executor against a one-rank replay, the dump, checkpoints)."""

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi_util import SMALL_GPT, python_script, run_mpi

from mpipar.analysis import load
from mpipar.config import ConfigError, load_config
from mpipar.parallel.pipeline.actions import Action, Schedule, ScheduleError, step_cuts
from mpipar.parallel.pipeline.check import check_schedule
from mpipar.parallel.pipeline.generators import build_schedule, weight_versions
from mpipar.parallel.pipeline.simulate import simulate
from mpipar.training.loop import drain_point


def _computes(s, r):
    return [a for a in s.ranks[r] if a.op in ("F", "BW")]


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 2), (2, 3), (4, 3), (4, 4), (4, 6)])
def test_continuous_schedules_check_and_warm_up_once(kind, pp, m):
    steps = 3
    s = build_schedule(kind, pp, m, steps=steps)
    check_schedule(s)
    assert s.asynchronous and s.steps == steps and s.total_microbatches == steps * m
    # the 1F1B order over all steps * m micro-batches: rank r is ahead by pp-r-1 forwards once,
    # not at every step (a flush would bring it back to zero at each step boundary)
    for r in range(pp):
        order = _computes(s, r)
        warm = min(pp - r - 1, steps * m)
        assert [a.op for a in order[:warm]] == ["F"] * warm
        ahead = max(sum(1 if a.op == "F" else -1 for a in order[:i]) for i in range(len(order)))
        assert ahead == warm + (1 if warm < steps * m else 0)
    ups = [a.mb for a in s.ranks[0] if a.op == "UPDATE"]
    assert ups == (list(range(steps * m)) if kind == "pipedream"
                   else [k * m + m - 1 for k in range(steps)])


def test_text_form_round_trips_steps_and_vsync():
    s = build_schedule("pipedream", 4, 3, steps=2, vertical_sync=True)
    t = Schedule.parse(s.format())
    assert (t.steps, t.vertical_sync, t.ranks) == (2, True, s.ranks)
    check_schedule(t)
    assert "steps=2 vsync=true" in s.format().splitlines()[0]


def test_weight_versions_2bw_vsync_and_plain():
    m = 3
    s = build_schedule("pipedream-2bw", 4, m, steps=3)
    assert all(v == j // m - 1 for (j, _), v in weight_versions(s).items())
    vs = weight_versions(build_schedule("pipedream", 4, 2, steps=3, vertical_sync=True))
    plain = weight_versions(build_schedule("pipedream", 4, 2, steps=3))
    assert all(vs[(j, c)] == plain[(j, 0)] for (j, c) in vs)
    assert any(vs[k] != plain[k] for k in vs)  # later stages do run on older versions


def test_checker_refuses_a_version_that_does_not_exist_yet():
    s = build_schedule("pipedream-2bw", 2, 2, steps=3)
    r0 = s.ranks[0]
    # move step 0's update (UPDATE1.0) to the end: step 2's forwards then need version 1 early
    up = Action("UPDATE", 1, 0)
    s.ranks[0] = [a for a in r0 if a != up]
    s.ranks[0].append(up)
    with pytest.raises(ScheduleError, match=r"F4.0 \(rank 0\) must run with weight version 1"):
        check_schedule(s)


@pytest.mark.parametrize("args,match", [
    (("1f1b", 2, 2), "only pipedream and pipedream-2bw run without a flush"),
    (("pipedream-2bw", 4, 2), r"microbatches >= pp - 1 = 3"),
])
def test_bad_continuous_settings_say_what_to_change(args, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(*args, steps=2)
    with pytest.raises(ScheduleError, match="vertical sync is PipeDream's"):
        build_schedule("pipedream-2bw", 2, 2, steps=2, vertical_sync=True)


def test_config_rules_for_continuous():
    with pytest.raises(ConfigError, match="continuous = true is for the generated pipedream and"):
        load_config(None, {"parallel.continuous": True, "parallel.schedule": "1f1b"})
    with pytest.raises(ConfigError, match="vertical_sync = true is for the generated pipedream s"):
        load_config(None, {"parallel.vertical_sync": True, "parallel.schedule": "1f1b"})
    load_config(None, {"parallel.continuous": True, "parallel.schedule": "pipedream-2bw"})


def test_step_cuts_end_each_step_after_its_last_action():
    s = build_schedule("pipedream", 2, 2, steps=3)
    for r in range(2):
        cuts = step_cuts(s, s.ranks[r])
        assert cuts[-1] == len(s.ranks[r])
        for k, cut in enumerate(cuts):
            assert all(s.step_of(a.mb) > k for a in s.ranks[r][cut:])
            assert s.step_of(s.ranks[r][cut - 1].mb) <= k


@pytest.mark.parametrize("kind,pp,m", [("pipedream", 2, 1), ("pipedream", 4, 3),
                                       ("pipedream-2bw", 2, 4), ("pipedream-2bw", 4, 3)])
def test_each_calls_stretches_tag_every_action_with_its_micro_batchs_step(kind, pp, m):
    """``continuous._stretches``: call k's actions in order, split where the step of their
    micro-batch changes, each stretch tagged with that step less k (what the tracer records)."""
    from mpipar.parallel.pipeline.continuous import _stretches

    s = build_schedule(kind, pp, m, steps=4)
    for r in range(pp):
        acts = s.ranks[r]
        cuts = step_cuts(s, acts)
        got = _stretches(s, acts, cuts)
        assert len(got) == len(cuts)
        lo = 0
        for k, runs in enumerate(got):
            covered = [i for a, b, _ in runs for i in range(a, b)]
            assert covered == list(range(lo, cuts[k]))
            for a, b, ahead in runs:
                assert {s.step_of(acts[i].mb) - k for i in range(a, b)} == {ahead}
            assert all(x[2] != y[2] for x, y in zip(runs, runs[1:]))  # maximal stretches
            lo = cuts[k]
        if r == 0:  # the first stage's calls run later steps' forwards too
            assert any(len(runs) > 1 for runs in got)


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
def test_simulated_continuous_run_has_no_flush_between_steps(kind):
    """A step's first forward on rank 0 starts before its previous step's last backward ends
    there (with a flush it could not), and the whole run is shorter than steps flushed ones."""
    pp, m, steps = 4, 4, 3
    s = build_schedule(kind, pp, m, steps=steps)
    sim = simulate(s)
    tl = sim.timeline[0]
    for k in range(1, steps):
        first_f = min(t0 for t0, _, a in tl if a.op == "F" and s.step_of(a.mb) == k)
        last_b = max(t1 for _, t1, a in tl if a.op == "BW" and s.step_of(a.mb) == k - 1)
        assert first_f < last_b
    flushed = simulate(build_schedule(kind, pp, m, steps=1)).makespan
    assert sim.makespan < steps * flushed - 1e-9


def test_drain_points_are_evaluations_checkpoints_and_the_end():
    cfg = load_config(None, {"train.steps": 10, "train.eval_interval": 4,
                             "run.checkpoint_interval": 3})
    assert [drain_point(cfg, i) for i in range(10)] == [2, 2, 2, 3, 5, 5, 7, 7, 8, 9]


# ---- against a one-rank replay of the weight versions (float64) --------------------------------

CASES = [  # (dp, pp, tp, m, kind, mode)
    (1, 2, 1, 1, "pipedream", "continuous"), (1, 2, 1, 2, "pipedream", "continuous"),
    (1, 4, 1, 3, "pipedream", "continuous"), (1, 4, 1, 4, "pipedream", "vsync"),
    (1, 4, 1, 6, "pipedream", "continuous"), (2, 2, 1, 3, "pipedream", "drains"),
    (1, 2, 1, 1, "pipedream-2bw", "continuous"), (1, 2, 1, 3, "pipedream-2bw", "continuous"),
    (1, 4, 1, 3, "pipedream-2bw", "continuous"), (1, 4, 1, 4, "pipedream-2bw", "drains"),
    (1, 4, 1, 6, "pipedream-2bw", "continuous"), (2, 2, 1, 2, "pipedream-2bw", "continuous"),
    (1, 2, 2, 2, "pipedream-2bw", "drains"), (1, 4, 1, 4, "pipedream", "recompute"),
    (1, 2, 1, 3, "pipedream-2bw", "recompute"),
    (1, 2, 1, 3, "pipedream", "auto"), (1, 4, 1, 3, "pipedream-2bw", "auto"),  # uneven cuts
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_continuous_matches_its_one_rank_replay(tokens, case):
    dp, pp, tp, m, kind, mode = case
    res = python_script(dp * pp * tp, "pipedream_equiv.py", tokens, dp, pp, tp, m, kind, mode,
                        timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ok  " in res.stdout


# ---- through `mpipar train`: the dump shows no flush; a resumed run equals the whole one -------

def _train(tokens, out, *extra, continuous=True):
    return [sys.executable, "-m", "mpipar.cli", "train", "--data", tokens, "--out", str(out),
            *SMALL_GPT, "--dtype", "float64", "--pp", "2", "--microbatches", "2",
            "--set", f"parallel.continuous={str(continuous).lower()}",
            "--set", "train.warmup_steps=0",
            "--set", "train.min_lr=1e-3", "--set", "train.lr=1e-3", *extra]


@pytest.mark.mpi
def test_dump_of_a_continuous_2bw_run_shows_no_flush(tokens, tmp_path):
    out = tmp_path / "run"
    res = run_mpi(2, _train(tokens, out, "--schedule", "pipedream-2bw", "--steps", "3"),
                  timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]

    ev = load(out / "trace.h5").events[0]  # the first stage: it warms up ahead
    kind = ev["kind"]
    for k in (1, 2):
        f_next = ev["start"][(kind == "F") & (ev["step"] == k)].min()
        b_last = ev["end"][(kind == "B") & (ev["step"] == k - 1)].max()
        # with a flush, step k's first forward starts after step k-1's last backward ends
        assert f_next < b_last, (k, f_next, b_last)
    # every action timed: the swap to the stashed weights (2BW: no zeroing, its gradients
    # accumulate over the step) is its own STASH event, right before each backward
    for r in (0, 1):
        e = load(out / "trace.h5").events[r]
        kinds = [k.decode() if isinstance(k, bytes) else k for k in e["kind"]]
        comp = [(k, x["mb"], x["chunk"], x["step"]) for k, x in zip(kinds, e)
                if k in ("F", "B", "STASH", "LOSS")]
        backs = [i for i, c in enumerate(comp) if c[0] == "B"]
        assert backs and all(comp[i - 1] == ("STASH",) + comp[i][1:] for i in backs), comp
    # the analysis takes one pipeline window over the measured steps (they overlap) and
    # simulates the continuous schedule over as many steps, and says it has no calibrated model
    from mpipar.analysis import breakdown
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.simulate import simulate

    s = breakdown(str(out / "trace.h5"))["summary"]
    assert 0 < s["bubble_pipeline"] < 1 and "continuous schedule" in s["predict_note"]
    costs = {k: c for k, c in s["costs"].items()}
    sim = simulate(build_schedule("pipedream-2bw", 2, 2, steps=s["steps_measured"]), costs=costs)
    assert s["bubble_sim"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    # and the calibrated one: the run's lists a step at a time (analysis.predict_continuous)
    assert "failed" not in s["predict_note"], s["predict_note"]
    assert 0 < s["bubble_pred"] < 1 and s["predicted"]["continuous_steps"] == 3
    # (the exact check is tests/test_costmodel.py's round trip; here timings are the load's)
    assert s["step_time_pred"] >= max(s["predicted"]["compute"]) > 0


@pytest.mark.mpi
@pytest.mark.parametrize("kind,continuous", [("pipedream-2bw", True), ("pipedream", True),
                                             ("pipedream-2bw", False)])
def test_a_resumed_continuous_run_equals_the_uninterrupted_one(tokens, tmp_path, kind,
                                                               continuous):
    """2BW's older buffer is checkpointed (with or without a flush per step); a continuous run
    drains before each checkpoint, so the resumed run sees what the whole one saw."""
    def final(out):
        with h5py.File(out / "checkpoints" / "step_000004.h5") as f:
            return {k: np.asarray(f[k]) for k in f["params"].keys() for k in [f"params/{k}"]}

    whole, half = tmp_path / "whole", tmp_path / "half"
    common = ("--schedule", kind, "--set", "run.checkpoint_final=true")
    res = run_mpi(2, _train(tokens, whole, *common, "--steps", "4", "--set",
                            "run.checkpoint_interval=2", continuous=continuous), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_mpi(2, _train(tokens, half, *common, "--steps", "2", continuous=continuous),
                  timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_mpi(2, _train(tokens, half, *common, "--steps", "4", "--resume", "latest",
                            continuous=continuous),
                  timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads(Path(whole / "metrics.json").read_text())["losses"]
    b = json.loads(Path(half / "metrics.json").read_text())["losses"]
    assert a[2:] == b[-2:]
    fa, fb = final(whole), final(half)
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)


def test_schedule_command_simulates_and_charts_a_continuous_schedule(tmp_path):
    import subprocess

    png = tmp_path / "c.png"
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "schedule", "--kind", "pipedream",
                          "--pp", "4", "-m", "2", "--steps", "3", "--vertical-sync", "--png",
                          str(png), "--actions"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "steps=3 vsync=true" in res.stdout
    assert "3 steps without a flush" in res.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "schedule", "--kind", "1f1b",
                          "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "run without a flush" in res.stderr


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
@pytest.mark.parametrize("pp,m,steps", [(2, 2, 3), (4, 4, 3), (4, 6, 2), (8, 8, 4)])
def test_unit_cost_bubble_is_one_flush_for_all_steps(kind, pp, m, steps):
    """F = 1, BW = 2, free updates and messages: 1F1B's bubble (p-1)/(n+p-1) with n = steps * m
    micro-batches, i.e. the warm-up and drain paid once instead of once per step."""
    sim = simulate(build_schedule(kind, pp, m, steps=steps))
    n = steps * m
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (n + pp - 1), abs=1e-12)
