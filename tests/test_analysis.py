"""Analysis of timing dumps: exact answers on hand-built events, clear errors, the CLI."""

import csv
import io
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from mpipar.analysis import DumpError, breakdown, compare, load, summarize, union_length
from mpipar.analysis import flops as fl
from mpipar.analysis import synthetic as sy
from mpipar.cli import main

ev = sy.ev

# a tiny GPT: N = 12*l*h^2 + V*h = 12*2*64 + 16*8 = 1664 matmul weights, 3*4 = 12 tokens per step
CONFIG = sy.gpt_config(
    model={"kind": "gpt", "n_layer": 2, "n_embd": 8, "n_head": 2, "vocab_size": 16, "seq_len": 4},
    batch_size=3,
    microbatches=2,
    schedule="gpipe",
)


def two_rank_events():
    """pp=2, two micro-batches. Step 0 is a (different) warm-up, steps 1 and 2 are measured.

    Step 1 (STEP windows [10, 20] on both ranks), by hand:
      rank 0: F 2 s, B 4 s, OPT 0.5; pp.send [11, 11.5] overlaps F mb1 (non-blocking post),
              pp.send [12, 12.2], world [19.7, 19.8]
              busy = [10, 12.2] + [15, 19] + [19.2, 19.8] = 6.8 -> idle 3.2, exposed 0.3
              bubble = 1 - 6/10 = 0.4
      rank 1: F 2, LOSS 0.4, B 4, OPT 0.5; pp 1.6 + 0.1 + 0.1 = 1.8 s, world 0.4
              busy = [10, 18.2] + [19, 19.9] = 9.1 -> idle 0.9, exposed 9.1 - 6.9 = 2.2
              bubble = 1 - 6.4/10 = 0.36
    Step 2 = step 1 shifted by 20 s, but the STEP windows are [30, 42]: 2 s more idle each.
    """

    def rank0(step, t, end):
        return [
            ev("STEP", step, t, end),
            ev("F", step, t, t + 1, mb=0, chunk=0),
            ev("pp.send", step, t + 1, t + 1.5, mb=0, chunk=0, nbytes=256, peer=1),
            ev("F", step, t + 1, t + 2, mb=1, chunk=0),
            ev("pp.send", step, t + 2, t + 2.2, mb=1, chunk=0, nbytes=256, peer=1),
            ev("B", step, t + 5, t + 7, mb=0, chunk=0),
            ev("B", step, t + 7, t + 9, mb=1, chunk=0),
            ev("OPT", step, t + 9.2, t + 9.7),
            ev("world.allreduce", step, t + 9.7, t + 9.8, nbytes=8),
        ]

    def rank1(step, t, end):
        return [
            ev("STEP", step, t, end),
            ev("pp.recv", step, t, t + 1.6, mb=0, chunk=0, nbytes=256, peer=0),
            ev("F", step, t + 1.6, t + 2.6, mb=0, chunk=0),
            ev("LOSS", step, t + 2.6, t + 2.8, mb=0, chunk=0),
            ev("B", step, t + 2.8, t + 4.8, mb=0, chunk=0),
            ev("pp.send", step, t + 4.8, t + 4.9, mb=0, chunk=0, nbytes=256, peer=0),
            ev("pp.recv", step, t + 4.9, t + 5.0, mb=1, chunk=0, nbytes=256, peer=0),
            ev("F", step, t + 5, t + 6, mb=1, chunk=0),
            ev("LOSS", step, t + 6, t + 6.2, mb=1, chunk=0),
            ev("B", step, t + 6.2, t + 8.2, mb=1, chunk=0),
            ev("OPT", step, t + 9, t + 9.5),
            ev("world.allreduce", step, t + 9.5, t + 9.9, nbytes=8),
        ]

    warm = [ev("STEP", 0, 0, 5), ev("F", 0, 0, 4.5, mb=0, chunk=0)]
    outside = [ev("world.barrier", -1, 9.0, 9.9)]  # step -1: not part of any step
    r0 = outside + warm + rank0(1, 10.0, 20.0) + rank0(2, 30.0, 42.0)
    r1 = outside + warm + rank1(1, 10.0, 20.0) + rank1(2, 30.0, 42.0)
    return [r0, r1]


@pytest.fixture
def dump2(tmp_path):
    return sy.write(
        tmp_path / "trace.h5",
        two_rank_events(),
        grid={"dp": 1, "pp": 2, "tp": 1},
        config=CONFIG,
        attrs={"peak_flops": 1e6},
    )


# --- union of intervals ------------------------------------------------------------------------


def test_union_length_by_hand():
    assert union_length([0, 1, 5], [2, 3, 6]) == pytest.approx(4.0)  # [0,3] + [5,6]
    assert union_length([0, 0.5], [4, 1]) == pytest.approx(4.0)  # nested
    assert union_length([0, 5], [10, 7], lo=2, hi=6) == pytest.approx(4.0)  # clipped
    assert union_length([], []) == 0.0
    assert union_length([3], [3]) == 0.0


def test_union_length_random_against_grid():
    rng = np.random.default_rng(1)
    # endpoints on a 0.01 grid, so counting covered grid cells is exact
    s = rng.integers(0, 1000, 60)
    e = s + rng.integers(1, 200, 60)
    covered = np.zeros(1300, dtype=bool)
    for a, b in zip(s, e, strict=True):
        covered[a:b] = True
    assert union_length(s * 0.01, e * 0.01) == pytest.approx(covered.sum() * 0.01, rel=1e-12)


# --- breakdown: exact answers ------------------------------------------------------------------


def test_breakdown_exact(dump2):
    res = breakdown(load(dump2))
    assert res["steps"] == [1, 2]
    assert any("step 0 skipped as warm-up" in n for n in res["notes"])
    t = res["ranks"]
    assert t["rank"].tolist() == [0, 1] and t["pp"].tolist() == [0, 1]
    ap = lambda x: pytest.approx(x, rel=1e-12, abs=1e-12)  # noqa: E731
    # means over steps 1 and 2 (step windows 10 s and 12 s)
    assert t["step_time"] == ap([11.0, 11.0])
    assert t["F"] == ap([2.0, 2.0])
    assert t["B"] == ap([4.0, 4.0])
    assert t["LOSS"] == ap([0.0, 0.4])
    assert t["OPT"] == ap([0.5, 0.5])
    assert t["W"] == ap([0.0, 0.0]) and t["R"] == ap([0.0, 0.0])
    assert t["comm_pp"] == ap([0.7, 1.8])
    assert t["comm_world"] == ap([0.1, 0.4])
    assert t["comm_tp"] == ap([0.0, 0.0]) and t["comm_dp"] == ap([0.0, 0.0])
    # overlapping send: union, not sum (rank 0 busy 6.8 s, not 6.8 + 0.5)
    assert t["busy"] == ap([6.8, 9.1])
    assert t["idle"] == ap([(3.2 + 5.2) / 2, (0.9 + 2.9) / 2])
    assert t["exposed"] == ap([0.3, 2.2])
    # self time: each instant once, communication first (rank 0's send hides 0.5 s of F)
    assert t["self_F"] == ap([1.5, 2.0])
    assert t["self_pp"] == ap([0.7, 1.8])
    assert t["self_LOSS"] == ap([0.0, 0.4])
    assert t["self_world"] == ap([0.1, 0.4])
    total = sum(t[c] for c in t if c.startswith("self_")) + t["idle"]
    assert total == ap(t["step_time"])
    b0 = ((1 - 6 / 10) + (1 - 6 / 12)) / 2
    b1 = ((1 - 6.4 / 10) + (1 - 6.4 / 12)) / 2
    assert t["bubble"] == ap([b0, b1])

    s = res["summary"]
    assert s["bubble"] == ap((b0 + b1) / 2)
    # pipeline window: first compute start to last compute end over ranks (excluding OPT) = 9 s
    assert s["bubble_pipeline"] == ap(((1 - 6 / 9) + (1 - 6.4 / 9)) / 2)
    assert s["step_time"] == ap(11.0)
    assert s["tokens_per_step"] == 12
    assert s["tokens_per_s"] == ap(12 / 11)
    # Megatron's closed form as an independent oracle: 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    B, seq, l, h, V = 3, 4, 2, 8, 16
    megatron = 72 * B * seq * l * h * h * (1 + seq / (6 * h) + V / (12 * l * h))
    assert s["flops_per_step"] == ap(megatron)
    assert s["n_params"] == 1664
    assert s["flops_per_s"] == ap(megatron / 11)
    # both ranks on host "localhost", device "cpu": one device shares the measured peak
    assert s["devices"] == 1 and s["peak_source"] == "dump attr peak_flops"
    assert s["mfu"] == ap(megatron / 11 / 1e6)
    # costs for the simulator: mean per-chunk F, B; median pp transfer
    c = s["costs"]
    assert c["F"] == ap(1.0) and c["B"] == ap(2.0) and c["W"] == 0.0 and c["BW"] == ap(2.0)
    assert c["comm"] == ap(float(np.median([0.5, 0.2, 1.6, 0.1, 0.1] * 2)))


def test_breakdown_one_step_and_peak_override(dump2):
    res = breakdown(load(dump2), step=1, peak=5e5)
    assert res["steps"] == [1]
    t, s = res["ranks"], res["summary"]
    assert t["idle"] == pytest.approx([3.2, 0.9])
    assert t["bubble"] == pytest.approx([0.4, 0.36])
    assert s["step_time"] == pytest.approx(10.0)
    assert s["peak_source"] == "--peak" and s["mfu"] == pytest.approx(s["flops_per_s"] / 5e5)
    # step 0 alone is allowed when asked for
    assert breakdown(load(dump2), step=0)["summary"]["step_time"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"step 7 has no events; steps in the dump: 0-2"):
        breakdown(load(dump2), step=7)


def test_mfu_counts_gpu_devices(tmp_path):
    path = sy.write(
        tmp_path / "g.h5",
        two_rank_events(),
        grid={"dp": 1, "pp": 2, "tp": 1},
        config=CONFIG,
        attrs={"devices": json.dumps(["cuda:0", "cuda:1"])},
    )
    # rank attrs say "cpu" in the synthetic writer; rewrite them as GPUs
    import h5py

    with h5py.File(path, "a") as f:
        for r in range(2):
            f["ranks"][str(r)].attrs["device"] = f"cuda:{r}"
    s = breakdown(load(path), peak=1e9)["summary"]
    assert s["devices"] == 2
    assert s["mfu"] == pytest.approx(s["flops_per_s"] / 2e9)
    s = breakdown(load(path))["summary"]  # no peak anywhere
    assert math.isnan(s["mfu"]) and "pass --peak" in s["peak_source"]


def test_nested_collective_and_unknown_kind(tmp_path):
    """A tp all-reduce inside F: inclusive F keeps it, self time gives it to tp."""
    rows = [
        ev("STEP", 0, 0.0, 3.0),
        ev("F", 0, 0.0, 2.0, mb=0, chunk=0),
        ev("tp.allreduce", 0, 0.5, 0.8, mb=0, chunk=0, nbytes=64),
        ev("DATA", 0, 2.0, 2.5),  # a kind the schema does not list: "other"
    ]
    path = sy.write(tmp_path / "n.h5", [rows], grid={"dp": 1, "pp": 1, "tp": 1}, config=CONFIG)
    t = breakdown(load(path))["ranks"]
    assert t["F"] == pytest.approx([2.0]) and t["comm_tp"] == pytest.approx([0.3])
    assert t["self_F"] == pytest.approx([1.7]) and t["self_tp"] == pytest.approx([0.3])
    assert t["other"] == pytest.approx([0.5]) and t["self_other"] == pytest.approx([0.5])
    assert t["idle"] == pytest.approx([0.5]) and t["exposed"] == pytest.approx([0.5])
    assert t["bubble"] == pytest.approx([1 - 2 / 3])


def test_sectioned_config_of_mpipar_config(tmp_path):
    """The config as mpipar.config writes it: train/parallel/model sections."""
    cfg = {
        "model": {
            "kind": "gpt",
            "n_layer": 2,
            "n_embd": 8,
            "vocab_size": 16,
            "block_size": 64,
            "sizes": [32, 64, 10],
        },
        "train": {"batch_size": 3, "seq_len": 4, "dtype": "float64", "device": "cpu"},
        "parallel": {
            "dp": 1,
            "pp": 2,
            "tp": 1,
            "schedule": "gpipe",
            "microbatches": 2,
            "virtual_stages": 1,
        },
    }
    path = sy.write(
        tmp_path / "c.h5", two_rank_events(), grid={"dp": 1, "pp": 2, "tp": 1}, config=cfg
    )
    s = breakdown(load(path))["summary"]
    flat = breakdown(
        load(
            sy.write(
                tmp_path / "f.h5",
                two_rank_events(),
                grid={"dp": 1, "pp": 2, "tp": 1},
                config=CONFIG,
            )
        )
    )["summary"]
    assert s["tokens_per_step"] == 12  # train.seq_len, not the model's block_size
    assert s["flops_per_step"] == flat["flops_per_step"]
    assert (s["schedule"], s["microbatches"], s["dtype"]) == ("gpipe", 2, "float64")


def test_single_step_dump_is_measured_whole(tmp_path):
    rows = [ev("STEP", 0, 0.0, 2.0), ev("F", 0, 0.0, 0.5, mb=0), ev("B", 0, 0.5, 1.5, mb=0)]
    path = sy.write(tmp_path / "one.h5", [rows], grid={"dp": 1, "pp": 1, "tp": 1}, config=CONFIG)
    res = breakdown(load(path))
    assert res["steps"] == [0] and "no warm-up step skipped" in res["notes"][0]
    assert res["ranks"]["idle"] == pytest.approx([0.5])
    assert res["ranks"]["bubble"] == pytest.approx([0.25])


def test_mlp_flops_and_other_config_spellings():
    mlp = {"model": {"kind": "mlp", "sizes": [4, 8, 2]}, "batch_size": 5}
    assert fl.n_params(mlp) == 4 * 8 + 8 + 8 * 2 + 2
    assert fl.tokens_per_step(mlp) == 5
    assert fl.flops_per_step(mlp) == 6 * 58 * 5
    deep = {"model": {"d_in": 4, "d_hidden": 8, "d_out": 2, "n_layers": 3}, "batch_size": 5}
    assert fl.n_params(deep) == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2
    gpt = {"model": {"n_layer": 2, "n_embd": 8, "vocab_size": 16, "block_size": 4}, "batch_size": 3}
    assert fl.model_kind(gpt) == "gpt" and fl.tokens_per_step(gpt) == 12
    assert fl.flops_per_step({"model": {}, "batch_size": 3}) is None


# --- the simulator prediction ------------------------------------------------------------------


def _fake_pipeline(monkeypatch, calls):
    gen = types.ModuleType("mpipar.parallel.pipeline.generators")
    sim = types.ModuleType("mpipar.parallel.pipeline.simulate")

    def build_schedule(kind, pp, microbatches, virtual_stages=1):
        calls["schedule"] = (kind, pp, microbatches, virtual_stages)
        return "SCHEDULE"

    def simulate(schedule, costs):
        calls["costs"] = dict(costs)
        return types.SimpleNamespace(bubble_fraction=0.25, makespan=7.5, peak_activations=[2, 1])

    gen.build_schedule = build_schedule
    sim.simulate = simulate
    sim.textbook_bubble = lambda kind, pp, m, v: (pp - 1) / (m + pp - 1)
    monkeypatch.setitem(sys.modules, "mpipar.parallel.pipeline.generators", gen)
    monkeypatch.setitem(sys.modules, "mpipar.parallel.pipeline.simulate", sim)


def test_prediction_uses_schedule_and_measured_costs(dump2, monkeypatch):
    calls = {}
    _fake_pipeline(monkeypatch, calls)
    s = breakdown(load(dump2))["summary"]
    assert calls["schedule"] == ("gpipe", 2, 2, 1)
    # the simulator takes per-stage costs: per-chunk costs times virtual (1 here)
    assert calls["costs"]["F"] == pytest.approx(1.0) and calls["costs"]["BW"] == pytest.approx(2.0)
    assert set(calls["costs"]) == {"F", "B", "W", "BW", "comm"}
    assert s["bubble_sim"] == 0.25 and s["sim_makespan"] == 7.5
    assert s["bubble_textbook"] == pytest.approx(1 / 3)


def test_prediction_scales_chunk_costs_by_virtual(tmp_path, monkeypatch):
    calls = {}
    _fake_pipeline(monkeypatch, calls)
    cfg = dict(CONFIG, schedule="interleaved", virtual_stages=2)
    path = sy.write(
        tmp_path / "v.h5", two_rank_events(), grid={"dp": 1, "pp": 2, "tp": 1}, config=cfg
    )
    s = breakdown(load(path))["summary"]
    assert calls["schedule"] == ("interleaved", 2, 2, 2)
    assert calls["costs"]["F"] == pytest.approx(2.0) and calls["costs"]["BW"] == pytest.approx(4.0)
    assert s["costs"]["F"] == pytest.approx(1.0)  # reported as measured, per chunk


def test_real_simulator_if_present(dump2):
    """With the real schedule module: a GPipe prediction within [0, 1), textbook (p-1)/(m+p-1)."""
    pytest.importorskip("mpipar.parallel.pipeline.simulate")
    s = breakdown(load(dump2))["summary"]
    assert s["bubble_textbook"] == pytest.approx(1 / 3), s["predict_note"]
    assert 0.0 <= s["bubble_sim"] < 1.0, s["predict_note"]


def test_prediction_degrades_without_simulator(dump2, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpipar.parallel.pipeline.simulate", None)
    s = breakdown(load(dump2))["summary"]
    assert s["bubble_sim"] == "n/a" and s["bubble_textbook"] == "n/a"
    assert "simulator unavailable" in s["predict_note"]


# --- loading: clear errors ---------------------------------------------------------------------


def test_load_exposes_run(dump2):
    run = load(dump2)
    assert run.world_size == 2 and run.grid["pp"] == 2 and run.config["schedule"] == "gpipe"
    assert run.events[0].dtype.names == (
        "kind",
        "step",
        "mb",
        "chunk",
        "start",
        "end",
        "bytes",
        "peer",
    )
    assert run.events[0]["kind"][0] == "world.barrier"  # str, not bytes
    assert run.coord(1) == {"dp": 0, "pp": 1, "tp": 0} and run.label(1) == "r1 dp0/pp1/tp0"
    assert run.complete and run.peak_flops == 1e6 and run.metrics is None
    assert run.steps() == [0, 1, 2]


def test_missing_file(tmp_path):
    with pytest.raises(DumpError, match=r"nope\.h5: no such file; pass the trace\.h5"):
        load(tmp_path / "nope.h5")


def test_not_hdf5(tmp_path):
    p = tmp_path / "junk.h5"
    p.write_text("hello")
    with pytest.raises(DumpError, match=r"junk\.h5: not a readable HDF5 file"):
        load(p)


@pytest.mark.parametrize("version,words", [(0, "older"), (3, "newer")])
def test_other_schema_version(tmp_path, version, words):
    p = sy.write(
        tmp_path / "v.h5",
        two_rank_events(),
        grid={"dp": 1, "pp": 2, "tp": 1},
        schema_version=version,
    )
    with pytest.raises(DumpError, match=rf"v\.h5: dump schema_version {version} is {words}") as e:
        load(p)
    assert ("upgrade mpipar" if version == 3 else "re-run the training") in str(e.value)


@pytest.mark.parametrize("attr", ["schema_version", "config", "grid", "world_size"])
def test_missing_attribute(tmp_path, attr):
    p = sy.write(
        tmp_path / "a.h5", two_rank_events(), grid={"dp": 1, "pp": 2, "tp": 1}, drop_attrs=(attr,)
    )
    with pytest.raises(DumpError, match=rf"a\.h5: file attribute '{attr}' is missing") as e:
        load(p)
    assert "re-run" in str(e.value)


def test_missing_event_field(tmp_path):
    p = sy.write(
        tmp_path / "f.h5", two_rank_events(), grid={"dp": 1, "pp": 2, "tp": 1}, drop_fields=("end",)
    )
    with pytest.raises(DumpError, match=r"f\.h5: dataset '/ranks/0/events' has no field 'end'"):
        load(p)


def test_inconsistent_grid_and_missing_rank(tmp_path):
    p = sy.write(
        tmp_path / "g.h5",
        two_rank_events(),
        grid={"dp": 1, "pp": 4, "tp": 1},
        coords=[(0, 0, 0), (0, 1, 0)],
    )
    with pytest.raises(DumpError, match=r"has 4 ranks but world_size is 2"):
        load(p)
    import h5py

    p = sy.write(tmp_path / "m.h5", two_rank_events(), grid={"dp": 1, "pp": 2, "tp": 1})
    with h5py.File(p, "a") as f:
        del f["ranks/1"]
    with pytest.raises(DumpError, match=r"group '/ranks/1' is missing"):
        load(p)


def test_reads_the_real_writer(tmp_path):
    """mpipar.trace.write_dump (the training's writer) and this reader agree on the schema."""
    trace = pytest.importorskip("mpipar.trace")
    if not hasattr(trace, "write_dump"):
        pytest.skip("mpipar.trace has no write_dump yet")
    events = []
    for rows in two_rank_events():
        events.append(np.array([tuple(r) for r in rows], dtype=trace.EVENT_DTYPE))
    path = tmp_path / "trace.h5"
    trace.write_dump(
        path,
        events,
        [{"dp": 0, "pp": p, "tp": 0, "hostname": "h", "device": "cpu"} for p in range(2)],
        {
            "config": CONFIG,
            "grid": {"dp": 1, "pp": 2, "tp": 1, "order": "tp-pp-dp"},
            "world_size": 2,
            "complete": True,
        },
    )
    ours = breakdown(load(tmp_path / "trace.h5"))["ranks"]
    ref = breakdown(
        load(
            sy.write(
                tmp_path / "s.h5",
                two_rank_events(),
                grid={"dp": 1, "pp": 2, "tp": 1},
                config=CONFIG,
            )
        )
    )["ranks"]
    for col in ("idle", "bubble", "busy", "comm_pp"):
        assert ours[col] == pytest.approx(ref[col], rel=1e-12)


# --- comparison, summarize, CLI ----------------------------------------------------------------


def test_compare_and_summarize(dump2, tmp_path):
    other = sy.write(
        tmp_path / "pp4.h5",
        sy.pipeline_events(pp=4, microbatches=4, steps=2),
        grid={"dp": 1, "pp": 4, "tp": 1},
    )
    table = compare([dump2, other])
    assert table["run"].tolist() == [os.path.basename(tmp_path), "pp4"]
    assert table["world_size"].tolist() == [2.0, 4.0]
    d = summarize(dump2)
    json.dumps(d)  # JSON-ready: no numpy, no NaN
    assert d["summary"]["bubble"] == pytest.approx(breakdown(load(dump2))["summary"]["bubble"])
    assert d["ranks"]["idle"] == pytest.approx([4.2, 1.9])


def test_cli_text(dump2, capsys):
    assert main(["analyze", dump2]) == 0
    out = capsys.readouterr().out
    assert "r0 dp0/pp0/tp0" in out and "r1 dp0/pp1/tp0" in out
    assert "peak used: 1.000e+06 FLOP/s per device x 1 device(s), from dump attr peak_flops" in out
    assert "step 0 skipped as warm-up" in out
    assert "comparison:" in out


def test_cli_csv_json_and_directory(dump2, tmp_path, capsys):
    sub = tmp_path / "sweep" / "pp4"
    sub.mkdir(parents=True)
    sy.write(
        sub / "trace.h5",
        sy.pipeline_events(pp=4, microbatches=4, steps=2),
        grid={"dp": 1, "pp": 4, "tp": 1},
    )
    assert main(["analyze", dump2, str(tmp_path / "sweep"), "--format", "csv"]) == 0
    text = capsys.readouterr().out
    ranks_part, compare_part = text.split("\n\n")
    rows = list(csv.DictReader(io.StringIO(ranks_part)))
    assert len(rows) == 2 + 4 and rows[-1]["run"] == "pp4"
    assert float(rows[0]["idle"]) == pytest.approx(4.2)
    cmp_rows = list(csv.DictReader(io.StringIO(compare_part)))
    assert [r["run"] for r in cmp_rows][1] == "pp4"

    assert main(["analyze", dump2, "--format", "json", "--step", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["steps"] == [1]
    assert data["runs"][0]["ranks"][0]["bubble"] == pytest.approx(0.4)
    assert data["comparison"][0]["step_time"] == pytest.approx(10.0)


def test_cli_errors(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing.h5")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path)]) == 2
    assert "holds no trace.h5" in capsys.readouterr().err


def test_cli_does_not_import_mpi(dump2):
    code = (
        "import sys; from mpipar.cli import main; rc = main(['analyze', sys.argv[1]]); "
        "assert 'mpi4py' not in sys.modules, 'analysis imported mpi4py'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, dump2], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_to_dataframe(dump2):
    pytest.importorskip("pandas")
    from mpipar.analysis import to_dataframe

    df = to_dataframe(breakdown(load(dump2))["ranks"])
    assert len(df) == 2 and df["idle"].tolist() == pytest.approx([4.2, 1.9])


# --- the calibrated cost model, predicted beside measured, Chrome traces -----------------------

def test_fit_from_unit_durations(dump2):
    from mpipar.analysis.costmodel import fit
    from mpipar.parallel.pipeline.generators import build_schedule

    run = load(dump2)
    model, _ = fit(run, [1, 2], build_schedule("gpipe", 2, 2))
    # F carries LOSS on the last stage; a BW action is one B event
    assert model.per_unit[(0, 0, "F")] == pytest.approx(1.0)
    assert model.per_unit[(1, 0, "F")] == pytest.approx(1.2)
    assert model.per_unit[(0, 0, "BW")] == pytest.approx(2.0)
    assert model.optimizer == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}
    # OPT end to STEP end: step 1 min(0.3, 0.5), step 2 min(2.3, 2.5): median 1.3
    assert model.step_post == pytest.approx(1.3)
    s = breakdown(run)["summary"]
    assert s["step_time_pred"] > 0 and 0 <= s["bubble_pred"] < 1, s["predict_note"]
    assert len(s["predicted"]["compute"]) == 2


@pytest.fixture(scope="module")
def real8(tmp_path_factory):
    """A real training dump: tiny GPT, dp=2 pp=2 tp=2 (8 ranks), 1F1B, 3 steps."""
    from mpi_util import run_mpi

    from mpipar.datasets import prepare_synthetic

    tmp = tmp_path_factory.mktemp("real8")
    tokens = tmp / "pattern.h5"
    prepare_synthetic(tokens, "pattern", 20000, 256, seed=1)
    out = tmp / "run"
    res = run_mpi(8, [sys.executable, "-m", "mpipar.cli", "train", "--data", tokens, "--out",
                      out, "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set",
                      "model.n_head=4", "--set", "model.block_size=16", "--seq-len", "16",
                      "--batch-size", "8", "--set", "train.eval_interval=0", "--quiet",
                      "--dp", "2", "--pp", "2", "--tp", "2", "--microbatches", "2",
                      "--steps", "3"], timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return out / "trace.h5"


def test_chrome_trace_of_real_dump_and_its_prediction(real8, tmp_path, capsys):
    both, pred = tmp_path / "both.json", tmp_path / "pred.json"
    assert main(["analyze", str(real8), "--chrome-trace", str(both)]) == 0
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "pp1 peak memory (MiB)" in out
    events = json.loads(both.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and "mb" in e["args"] and "chunk" in e["args"] for e in slices)
    tracks = {(e["pid"], e["tid"]) for e in slices}
    assert {t for p, t in tracks if p == 1} == set(range(8))  # measured: one track per rank
    assert {t for p, t in tracks if p == 2} == {0, 1}  # predicted: one per pipeline rank
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"measured: run", "predicted: run"}
    assert {e["cat"] for e in slices if e["pid"] == 1} >= {"compute", "comm"}
    assert {e["name"] for e in slices if e["pid"] == 2} >= {"F", "BW", "SEND_F", "RECV_B"}
    # the predicted run alone in its own file
    assert main(["analyze", str(real8), "--chrome-trace", str(both),
                 "--chrome-trace-predicted", str(pred)]) == 0
    assert {e["pid"] for e in json.loads(pred.read_text())["traceEvents"]} == {2}
    assert {e["pid"] for e in json.loads(both.read_text())["traceEvents"]} == {1}
    s = breakdown(load(real8))["summary"]
    assert s["memory_measured"] is not None and len(s["memory_measured"]) == 8
    assert s["step_time_pred"] > 0 and s["predicted"]["memory"][0] > 0
