"""Dumps at scale: the analysis's numbers pinned against the implementation that refitted every
step over all events, step selection and sampling, the step index, realistic synthetic dumps,
and the per-rank parts layout (a missing or stale part, resuming, the old single file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mpipar import trace_parts as parts
from mpipar.analysis import DumpError, breakdown, load
from mpipar.analysis.index import events_in
from mpipar.analysis.steps import StepChoice, StepError, even_sample, parse_window
from mpipar.trace import EVENT_DTYPE, METRICS_DTYPE, Tracer, rewind_dump

DATA = Path(__file__).parent / "data"
# steps 0-5 of the README's main job (dp2 pp2 tp2, 1F1B, m = 4), schema-1 single file, as the
# gather-to-rank-0 writer wrote it (gzip-compressed copy, to keep it small)
README_V1 = DATA / "readme_v1_steps0-5.h5"

# `mpipar analyze --format json` of README_V1 by the implementation before the step index
# (commit 7a95728): every per-step fit masked all events with np.isin
PINNED = {
    "step_time": 0.34387820740003006,
    "bubble": 0.3428132651360621,
    "bubble_pipeline": 0.32705635100163805,
    "step_time_pred": 0.3357271002774405,
    "bubble_pred": 0.32134008498768757,
    "bubble_step_pred": 0.34083570023625087,
    "compute_frac": 0.7098184486244459,
    "exposed_frac": 0.2860122637690363,
}
PINNED_RANK_STEP = [0.33416343839999174, 0.3339382268000918, 0.3349987262000468]
PINNED_MEMORY = [5114880.0, 5422080.0, 5659648.0, 5524480.0, 4576256.0, 4531200.0, 4588544.0,
                 4584448.0]


def test_readme_dump_numbers_are_the_old_implementations():
    res = breakdown(load(README_V1))
    s = res["summary"]
    for key, want in PINNED.items():
        assert s[key] == pytest.approx(want, rel=1e-12, abs=1e-15), key
    assert list(res["ranks"]["step_time"][:3]) == pytest.approx(PINNED_RANK_STEP, rel=1e-12)
    assert s["memory_measured"] == PINNED_MEMORY
    assert res["notes"][0] == "steps 1-5 measured; step 0 skipped as warm-up"


def test_step_index_selects_what_a_mask_selects():
    run = load(README_V1)
    rng = np.random.default_rng(3)
    for r in range(run.world_size):
        ev = run.events[r]
        for steps in ([3], [1, 4], [5, 0, 2], list(range(-1, 7)), [9], []):
            got = events_in(run, r, steps)
            want = ev[np.isin(ev["step"], steps)]
            assert np.array_equal(got, want), (r, steps)
        perm = rng.permutation(6).tolist()[:3]
        assert np.array_equal(events_in(run, r, perm), ev[np.isin(ev["step"], perm)])


def test_step_choice_window_sample_and_notes():
    assert parse_window("100:200") == (100, 200) and parse_window(":7") == (None, 7)
    assert even_sample(list(range(1, 11)), 4) == [1, 4, 7, 10]
    for bad, words in (("x", "give a window A:B"), ("5:5", "window is empty"),
                       ("-1:3", "steps count from 0")):
        with pytest.raises(ValueError, match=words):
            parse_window(bad)
    steps, notes = StepChoice(sample=2).choose(list(range(0, 6)), "p")
    assert steps == [1, 5] and "a sample of 2 of the 5 steps 1-5" in notes[0]
    steps, notes = StepChoice(window=(2, 4)).choose(list(range(0, 6)), "p")
    assert steps == [2, 3] and notes == ["steps 2-3 measured (--steps window)"]
    with pytest.raises(StepError, match="no steps in --steps 9:"):
        StepChoice(window=(9, None)).choose(list(range(6)), "p")
    with pytest.raises(ValueError, match="--step takes one step"):
        StepChoice(step=2, sample=3)


def test_loading_a_sample_reads_only_its_rows():
    full = load(README_V1)
    run = load(README_V1, steps=StepChoice(sample=2))
    assert run.selection[0] == [1, 5]
    for r in range(run.world_size):
        ev, all_ev = run.events[r], full.events[r]
        kept = np.isin(all_ev["step"], [1, 5]) | (all_ev["step"] < 0) | np.isin(
            all_ev["kind"], ["mem.static", "mem.base"])
        assert np.array_equal(ev, all_ev[kept]), r
    res = breakdown(run)
    assert res["steps"] == [1, 5] and "--sample" in res["notes"][0]
    # the memory measurement still finds the set-up markers of step 0
    assert res["summary"]["memory_measured"] is not None


def test_cli_sample_says_what_it_sampled(tmp_path, capsys):
    from mpipar.analysis.synthetic_run import write_run
    from mpipar.cli import main

    path = tmp_path / "syn.h5"
    info = write_run(path, dp=2, pp=2, tp=1, steps=12, schedule="1f1b", microbatches=4)
    assert info["ranks"] == 4 and info["events"] > 4 * 12 * 20
    assert main(["analyze", str(path), "--sample", "3"]) == 0
    out = capsys.readouterr().out
    assert "steps 1,6,11 measured: a sample of 3 of the 11 steps 1-11" in out
    assert main(["analyze", str(path), "--steps", "4:99", "--step", "5"]) == 2
    assert "--step takes one step" in capsys.readouterr().err


def test_synthetic_run_is_a_plausible_pipeline(tmp_path):
    from mpipar.analysis.synthetic_run import write_run

    path = tmp_path / "syn.h5"
    write_run(path, dp=2, pp=4, tp=2, steps=6, schedule="gpipe", microbatches=4)
    run = load(path)
    assert run.world_size == 16 and run.complete
    res = breakdown(run)
    s = res["summary"]
    # compute sits inside the step; the schedule leaves a bubble like the textbook's or more
    assert 0 < s["bubble_pipeline"] < 1 and s["bubble_pipeline"] >= s["bubble_textbook"] - 0.05
    assert isinstance(s["step_time_pred"], float) and s["step_time_pred"] > 0
    for ev in run.events:
        assert np.all(ev["end"] >= ev["start"])
        p2p = ev[np.char.startswith(ev["kind"], "pp.")]
        assert p2p.size and np.all((p2p["peer"] >= 0) & (p2p["peer"] < 16))


# ----- the parts layout, written without MPI ----------------------------------------------------


def _rank_events(rank: int, steps) -> np.ndarray:
    t = Tracer()
    for s in steps:
        t.step = s
        t.record("STEP", s, s + 0.9)
        t.record("F", s + 0.1, s + 0.4, mb=0, chunk=0)
        t.record("B", s + 0.4, s + 0.8, mb=0, chunk=0)
    return t.events()


def _write_parts(path, world: int, steps, run_id="run-a", skip=()):
    grid = {"dp": world, "pp": 1, "tp": 1, "order": "tp-dp-pp"}
    parts.write_index(path, {"config": {"schedule": "gpipe", "microbatches": 1}, "grid": grid},
                      world, run_id)
    for r in range(world):
        if r in skip:
            continue
        m = np.empty(0, METRICS_DTYPE)
        parts.write_part(path, r, run_id, _rank_events(r, steps[:1]), {"dp": r, "pp": 0, "tp": 0},
                         m)
        for s in steps[1:]:
            parts.append_part(path, r, _rank_events(r, [s]), {"dp": r, "pp": 0, "tp": 0}, m,
                              complete=s == steps[-1])
    parts.update_index(path, {"complete": True})


def test_parts_layout_round_trip(tmp_path):
    path = tmp_path / "trace.h5"
    _write_parts(path, 3, [0, 1, 2])
    run = load(path)
    assert run.schema_version == 2 and run.complete and not run.notes
    assert [sorted(set(e["step"].tolist())) for e in run.events] == [[0, 1, 2]] * 3
    assert run.coords.tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0]]
    assert sorted(os.listdir(tmp_path / "trace.parts")) == [parts.part_name(r) for r in range(3)]
    import h5py

    with h5py.File(parts.part_path(path, 0)) as f:  # finished: rewritten compressed
        assert f["events"].compression == "gzip" and f["events"].shuffle


def test_a_missing_or_stale_part_leaves_the_others_readable(tmp_path):
    path = tmp_path / "trace.h5"
    _write_parts(path, 3, [0, 1], skip=(1,))
    run = load(path)
    assert not run.complete and "ranks [1] have no part of this run" in run.notes[0]
    assert len(run.events[1]) == 0 and run.coords[1].tolist() == [1, 0, 0]
    assert all(len(run.events[r]) == 6 for r in (0, 2))
    assert "ranks [1]" in " ".join(breakdown(run)["notes"])
    # a part an older run left in the same folder is not this run's
    _write_parts(tmp_path / "old.h5", 3, [0], run_id="old")
    os.replace(tmp_path / "old.parts" / parts.part_name(1),
               tmp_path / "trace.parts" / parts.part_name(1))
    assert "ranks [1]" in load(path).notes[0]


def test_uncommitted_rows_of_a_part_are_not_read(tmp_path):
    import h5py

    path = tmp_path / "trace.h5"
    _write_parts(path, 2, [0, 1])
    with h5py.File(parts.part_path(path, 0), "r+") as f:  # a flush cut before its commit
        ds = f["events"]
        n = ds.shape[0]
        ds.resize((n + 3,))
        ds[n:] = _rank_events(0, [7])
    assert 7 not in load(path).events[0]["step"]
    with h5py.File(parts.part_path(path, 0), "r+") as f:
        f.attrs["committed"] = json.dumps({"events": 999, "metrics": 0})
    with pytest.raises(DumpError, match="fewer event rows than its 'committed' count 999"):
        load(path)


def test_resume_rewinds_every_part(tmp_path):
    path = tmp_path / "trace.h5"
    _write_parts(path, 2, [0, 1, 2, 3])
    assert not rewind_dump(path, 2, 3)  # another world size: a new dump
    assert rewind_dump(path, 2, 2)
    run = load(path)
    assert not run.complete
    assert [sorted(set(e["step"].tolist())) for e in run.events] == [[0, 1]] * 2
    assert parts.index_run_id(path) == "run-a"
    # the resumed run appends to an uncompressed part again (appends move compressed chunks)
    parts.append_part(path, 0, _rank_events(0, [2]), {"dp": 0, "pp": 0, "tp": 0},
                      np.empty(0, METRICS_DTYPE))
    import h5py

    with h5py.File(parts.part_path(path, 0)) as f:
        assert f["events"].compression is None
    assert sorted(set(load(path).events[0]["step"].tolist())) == [0, 1, 2]


def test_old_single_file_and_event_dtype_still_match():
    run = load(README_V1)
    assert run.schema_version == 1 and run.world_size == 8 and run.complete
    assert EVENT_DTYPE.itemsize == 64  # the on-disk row both layouts share


_PART_APPENDER = """
import sys
import numpy as np
from mpipar import trace_parts as parts
from mpipar.trace import EVENT_DTYPE, METRICS_DTYPE
path, rank = sys.argv[1], int(sys.argv[2])
ev = np.zeros(500, dtype=EVENT_DTYPE)
ev["kind"], ev["start"] = b"F", np.arange(500.0)  # rows that compress unevenly
m = np.empty(0, METRICS_DTYPE)
a = {"dp": rank, "pp": 0, "tp": 0}
if rank == 0:
    parts.write_index(path, {"config": {}, "grid": {"dp": 2, "pp": 1, "tp": 1}}, 2, "k")
parts.write_part(path, rank, "k", ev, a, m)
print("ready", flush=True)
while True:
    ev["start"] += 1.0
    parts.append_part(path, rank, ev, a, m)
"""


def test_sigkill_during_part_flushes_leaves_every_part_readable(tmp_path):
    """Two ranks' writers append to their compressed parts without pause; one is killed at a
    random moment (6 times): the dump reads, the killed rank with whole flushes only, the other
    rank's part untouched by it."""
    import random
    import subprocess
    import sys
    import time

    rng = random.Random(29)
    for i in range(6):
        path = tmp_path / f"d{i}" / "trace.h5"
        path.parent.mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", _PART_APPENDER, str(path), str(r)],
                                  stdout=subprocess.PIPE, text=True) for r in (0, 1)]
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.4))
            procs[1].kill()  # a rank dies mid-run
            time.sleep(0.1)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        run = load(path)
        for ev in run.events:
            assert len(ev) % 500 == 0 and len(ev) >= 500, len(ev)
            k = len(ev) // 500  # flush j holds starts j .. j + 499, in order
            want = (np.arange(500.0)[None, :] + np.arange(k)[:, None]).ravel()
            assert np.array_equal(ev["start"], want)


# ----- the batched replays and the grouped breakdown ---------------------------------------------


def test_batched_replays_equal_one_simulation_each():
    """``batch_sim.evaluate`` gives, element by element, what ``simulate`` gives each (model,
    draw): fitted models with jitter and dp reductions, a draw-free replay, an interleaved
    schedule with two chunks (and two reductions) per rank."""
    from mpipar.analysis.batch_sim import Compiled, evaluate
    from mpipar.analysis.predict import replica_models
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import CostModel, simulate

    run = load(README_V1)
    sched, models, _, _ = replica_models(run, [1, 2, 3], "1f1b", 2, 4, 1)
    inter = lower(build_schedule("interleaved", 2, 4, virtual_stages=2))
    rng = np.random.default_rng(5)
    other = CostModel(per_unit={(r, c, op): float(rng.uniform(1, 2)) for r in range(2)
                                for c in range(4) for op in ("F", "B", "W", "BW")},
                      overhead=0.01, latency=0.05, send_post=0.02, recv_post=0.03,
                      dp_reduce={(r, c): float(rng.uniform(0.1, 3)) for r in range(2)
                                 for c in range(r, 4, 2)},
                      jitter=tuple(rng.uniform(0.5, 1.5, 16)))
    for s, mods in ((sched, models), (inter, [other])):
        draws = [None] + [(k, d) for k in range(3) for d in range(2)]
        batch_models = [mods[i % len(mods)] for i in range(len(draws))]
        b = evaluate(Compiled.of(s), batch_models, draws)
        for i, (m, d) in enumerate(zip(batch_models, draws, strict=True)):
            sim = simulate(s, m, draw=d)
            assert b.busy[i].tolist() == pytest.approx(sim.busy, rel=1e-14)
            assert b.pipe_comm[i].tolist() == pytest.approx(sim.pipe_comm, rel=1e-14)
            assert b.pipeline_end[i].tolist() == pytest.approx(sim.pipeline_end, rel=1e-14)
            assert b.overhead[i].tolist() == pytest.approx(sim.overhead, rel=1e-14)
            spans = [(a, e) for tl in sim.timeline for a, e, act in tl
                     if not act.op.startswith(("SEND", "RECV"))]
            assert b.first_compute[i] == min(a for a, _ in spans)
            assert b.last_compute[i] == max(e for _, e in spans)


def test_grouped_unions_equal_one_union_per_group():
    """One running maximum over steps one after another, and the step-at-a-time fallback when
    they overlap, both give ``union_length`` of each group."""
    from mpipar.analysis.rank_steps import grouped_union, union_length

    rng = np.random.default_rng(11)
    for overlap in (False, True):
        g = rng.integers(0, 6, 400)
        s = rng.uniform(0, 1, 400) + (0 if overlap else 2.0 * g)
        e = s + rng.exponential(0.05, 400) * (rng.random(400) > 0.1)  # some of length 0
        got = grouped_union(g, s, e, 7)
        want = [union_length(s[g == i], e[g == i]) for i in range(7)]
        assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert got[6] == 0.0


def test_memory_model_counts_the_timing_dump():
    """The README job's prediction carries the dump's part (events held between flushes and
    the writer), from the events each pipeline rank records per step, and the runtime term;
    the planner's call (no events) is unchanged."""
    from mpipar.analysis.memory_model import (
        DUMP_WRITER_BYTES,
        TRACE_EVENT_BYTES,
        predict_run,
        trace_bytes,
    )

    run = load(README_V1)
    parts = breakdown(run)["summary"]["predicted"]["memory_parts"]
    plain = predict_run(run.config, run.grid)
    for got, base in zip(parts, plain, strict=True):
        assert got["trace"] > 0
        assert got["total"] == base["total"] + got["trace"] + got["runtime"]
        assert "trace" not in base
    every = {"run": {"flush_interval": 50}, "train": {"steps": 200}}
    assert trace_bytes(every, 60) == 60 * 50 * TRACE_EVENT_BYTES + DUMP_WRITER_BYTES
    # no flush before the last step's peak: every step's events held, the writer not yet run
    for interval in (0, 200, 500):
        at_end = {"run": {"flush_interval": interval}, "train": {"steps": 200}}
        assert trace_bytes(at_end, 60) == 60 * 200 * TRACE_EVENT_BYTES
    assert trace_bytes({"run": {"trace": False}}, 60) == 0
