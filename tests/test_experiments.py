"""The experiment scripts: two run end to end in --quick mode (real mpiexec runs, a few seconds
each), the rest have their pure helpers checked. No timing assertions: only files, shapes and the
quantities that are exact (activation counts, tensor-parallel bytes)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
EXP = REPO / "experiments"
sys.path.insert(0, str(EXP))

import bubble  # noqa: E402
import common  # noqa: E402
import grids  # noqa: E402
import memory  # noqa: E402
import tp_comm  # noqa: E402


def run_quick(name: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(EXP / f"{name}.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**common.env()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for f in ("results.csv", "results.json", "results.md", f"{name}.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f"{name}: {f} missing"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    doc = json.loads((out / "results.json").read_text())
    assert len(rows) == len(doc["rows"]) > 0
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    return doc


def test_memory_quick_counts_match_simulator(tmp_path):
    doc = run_quick("memory", tmp_path / "memory")
    sim = [r for r in doc["rows"] if r["source"] == "sim"]  # new schedules at pp 4 and 8
    assert {(r["variant"], r["pp"]) for r in sim} == {("pipedream-2bw-cont", 4),
                                                     ("pipedream-2bw-cont", 8)}
    assert all(r["sim_peak"] == r["pp"] - r["rank"] for r in sim)  # 1F1B's, across steps
    rows = [r for r in doc["rows"] if r["source"] == "measured"]
    assert {r["variant"] for r in rows} == {"gpipe", "1f1b", "1f1b+recompute",
                                            "pipedream-2bw-cont"}
    for r in rows:
        # the dump proxy and the layers' saved contexts agree with the schedule simulator
        assert r["dump_peak"] == r["sim_peak"] == r["probe_peak"], r
        assert r["ctx_peak_MiB"] > 0 and r["pair_KiB"] > 0
    # GPipe holds every micro-batch on every stage; 1F1B at most pp - stage
    m, pp = doc["meta"]["microbatches"], doc["meta"]["pp"]
    assert all(r["sim_peak"] == m for r in rows if r["variant"] == "gpipe")
    assert all(r["sim_peak"] == pp - r["rank"] for r in rows
               if r["variant"] in ("1f1b", "pipedream-2bw-cont"))


def test_tp_comm_quick_bytes_match_megatron_count(tmp_path):
    doc = run_quick("tp_comm", tmp_path / "tp")
    rows = {(r["tp"], r["sp"]): r for r in doc["rows"]}
    assert rows[(1, False)]["calls"] == 0
    plain = rows[(2, False)]
    # without sequence parallelism every tp byte is one of the counted all-reduces
    assert plain["wire_MiB"] == pytest.approx(plain["pred_wire_MiB"], rel=1e-9)
    # sequence parallelism: same activation volume, plus the small partial-gradient all-reduce
    sp = rows[(2, True)]
    assert sp["wire_MiB"] >= sp["pred_wire_MiB"]
    assert sp["wire_MiB"] < 1.2 * sp["pred_wire_MiB"]


def test_helpers():
    assert common.balanced_boundaries(8, 4) == [0, 3, 5, 7]
    assert common.balanced_boundaries(8, 1) == [0]
    with pytest.raises(ValueError, match="multiple"):
        common.balanced_boundaries(8, 3)
    g = grids.grids(8)
    assert len(g) == 10 and all(a * b * c == 8 for a, b, c in g) and len(set(g)) == 10
    cfgs = list(bubble.configurations(quick=False))
    assert ("naive" in {c[1] for c in cfgs}) and all(c[3] % c[0] == 0 for c in cfgs
                                                      if c[1] == "interleaved")
    assert tp_comm.wire_bytes("tp.allreduce", 100, 4) == 150
    assert tp_comm.wire_bytes("tp.allgather", 100, 4) == 300
    assert tp_comm.wire_bytes("tp.reduce_scatter", 100, 4) == 75
    text = common.text_table([{"a": 1, "b": 0.5}], ["a", "b"])
    assert "0.500" in text


def test_dump_in_flight_counts_pairs():
    from mpipar.analysis.dump import EVENT_DTYPE

    def ev(kind, mb, start, end):
        return (kind, 0, mb, 0, start, end, 0, -1)

    # two forwards, then B of mb0 (frees it: no W events), then F of mb2, B, B
    rows = [ev("F", 0, 0, 1), ev("F", 1, 1, 2), ev("B", 0, 2, 3), ev("F", 2, 3, 4),
            ev("B", 1, 4, 5), ev("B", 2, 5, 6)]
    assert memory.dump_in_flight(np.array(rows, dtype=EVENT_DTYPE), 0) == 2
    # with split backward, W frees: F0 F1 B0 B1 W0 W1 holds both until the Ws
    rows = [ev("F", 0, 0, 1), ev("F", 1, 1, 2), ev("B", 0, 2, 3), ev("F", 2, 3, 4),
            ev("W", 0, 4, 5), ev("B", 1, 5, 6), ev("W", 1, 6, 7), ev("B", 2, 7, 8),
            ev("W", 2, 8, 9)]
    assert memory.dump_in_flight(np.array(rows, dtype=EVENT_DTYPE), 0) == 3


def test_calibrate_configurations():
    import calibrate

    cfgs = list(calibrate.configurations(quick=False))
    pp2 = {(s, m) for dp, pp, tp, s, v, m in cfgs if pp == 2}
    assert {("gpipe", 8), ("1f1b", 1), ("interleaved", 4), ("zb-h1", 2), ("naive", 1)} <= pp2
    assert (1, 1, 2, "1f1b", 1, 4) in cfgs and (2, 1, 1, "1f1b", 1, 4) in cfgs
    cont = list(calibrate.configurations(quick=False, continuous=True))
    assert {(s, m) for _, pp, _, s, _, m in cont} == {
        (s, m) for s in ("pipedream-cont", "pipedream-2bw-cont") for m in (2, 4, 8)}
    assert {(dp, pp, tp, v) for dp, pp, tp, _, v, _ in cont} == {(1, 2, 1, 1)}


@pytest.mark.parametrize("model, optimizer", [("mlp", "sgd"), ("tiny-stage", "adamw")])
def test_opt_block_times_every_block_size_with_the_same_bits(model, optimizer):
    """noflush_opt_block.py: a row per block size (the largest: the whole model in one block)
    with the three modes; it asserts the same bits at every block size itself."""
    proc = subprocess.run([sys.executable, str(EXP / "noflush_opt_block.py"), "--reps", "2",
                           "--model", model, "--optimizer", optimizer,
                           "--blocks", "4096,16384,1000000"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**common.env()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{optimizer} update of {model}") and "same bits" in lines[0]
    rows = [ln.split() for ln in lines[2:]]
    assert [r[0] for r in rows] == ["4096", "16384", "1000000"] and rows[-1][1] == "1"
    assert all(len(r) == 6 and all(float(v) > 0 for v in r[3:]) for r in rows)


def test_denormals_trains_both_copies_to_the_same_bits(tmp_path):
    """denormals.py --quick: rows of both copies' times and subnormal counts, the same bits."""
    proc = subprocess.run([sys.executable, str(EXP / "denormals.py"), "--quick",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**common.env()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["step"] for r in rows] == [50, 100, 150, 200]
    assert all(r["same_bits"] and r["opt_us_flush"] > 0 and r["step_us_off"] > 0 for r in rows)


def test_denormals_refuses_bad_arguments_with_a_message():
    for args in (["--every", "0"], ["--set", "train.optimizer"]):
        proc = subprocess.run([sys.executable, str(EXP / "denormals.py"), *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 2 and "denormals.py: error:" in proc.stderr


def test_cold_frames_prints_a_row_per_call_count():
    """cold_frames.py --quick: one table row per --calls value, each step timed."""
    proc = subprocess.run([sys.executable, str(EXP / "cold_frames.py"), "--quick",
                           "--calls", "1,2"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**common.env()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln.split("|")[1:-1] for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1", "2"]
    assert all(float(r[1].replace(",", "")) > 0 for r in rows[1:])
    bad = subprocess.run([sys.executable, str(EXP / "cold_frames.py"), "--calls", "0"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "--calls" in bad.stderr
