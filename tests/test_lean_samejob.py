"""experiments/lean_bench.py's same-job mode (experiments/lean_samejob.py): one job per case runs
the lean loop and mpipar in alternating blocks, on 1 and 2 ranks, in both data modes, and writes
its table and every block's time. No timing is asserted."""

import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import run_experiment

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))


def bench(tmp_path, *args):
    run_experiment("lean_bench.py", tmp_path, *args)
    return (tmp_path / "results.md").read_text()


def rows(text):
    """{case: cells} of the same-job table."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 7 and cells[0] != "case":
            out[cells[0]] = cells[1:]
    return out


def block_times(path):
    import h5py

    with h5py.File(path) as f:
        return {name: len(f[name]) for name in ("mlp-1rank/mpipar/lean", "mlp-1rank/mpipar/mpipar",
                                               "mlp-dp2/mpipar/lean", "mlp-dp2/mpipar/mpipar")}


@pytest.mark.mpi
def test_same_job_on_one_and_two_ranks_writes_its_table(tmp_path):
    text = bench(tmp_path, "--cases", "mlp-1rank,mlp-dp2")
    table = rows(text)
    assert set(table) == {"mlp-1rank", "mlp-dp2"}, text
    for case, (lean, mine, ratio, iqr, base, vs_base) in table.items():
        assert float(lean.replace(",", "")) > 0 and float(mine.replace(",", "")) > 0, case
        q1, q3 = (float(q) for q in iqr.split("-"))
        assert q1 <= float(ratio) <= q3, (case, ratio, iqr)
        assert base == vs_base == "-"  # no baseline checkout given
    assert "3 alternating block pairs" in text and "4 fixed batches" in text
    # the machine's steadiness before the runs and after them (mpipar/plan/steadiness.py)
    assert "before the runs:" in text and "after the runs:" in text
    assert text.count("machine steadiness") == 2
    assert set(block_times(tmp_path / "lean_bench_samejob.h5").values()) == {3}


@pytest.mark.mpi
def test_same_job_pipeline_with_drawn_rows_and_a_baseline(tmp_path):
    """A pipeline case (the lean loop takes mpipar's stage split), the lean loop drawing rows as
    mpipar does, and a baseline checkout (this one) timed against the same lean loop."""
    text = bench(tmp_path, "--cases", "mlp-pp2-1f1b", "--lean-data-rows", "3686",
                 "--baseline", str(ROOT))
    (cells,) = rows(text).values()
    assert float(cells[4]) > 0 and float(cells[5]) > 0, text
    assert "rows drawn from 3686" in text


def test_summary_takes_the_median_and_quartiles_of_the_per_pair_ratios():
    from lean_samejob import summary

    times = {"lean": [1.0, 1.0, 2.0, 1.0, 3.0], "mpipar": [2.0, 1.0, 2.0, 0.5, 2.0]}
    s = summary(times, block=10, batch=128)
    # ratios mpipar/lean as speeds = lean time / mpipar time: 0.5, 1, 1, 2, 1.5
    assert s["ratio"] == 1.0 and (s["q1"], s["q3"]) == (1.0, 1.5) and s["pairs"] == 5
    assert s["lean"] == 1280.0 and s["mpipar"] == 640.0  # samples/s: 128 * 10 / seconds


def test_bad_block_settings_are_refused_in_one_line():
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "lean_bench.py"),
                          "--block", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--block-pairs and --rounds must each be >= 1" in res.stderr


def test_rounds_alternate_which_checkout_runs_first_and_take_medians(monkeypatch):
    """Two checkouts' jobs run one after the other: the order alternates from case to case and
    from round to round, and a row gives the median over the rounds (the range of their ratios
    in the IQR column)."""
    import types

    import lean_samejob

    calls = []
    speed = {"new": [2.0, 4.0], "old": [1.0, 1.0]}  # mpipar's block time per round: lean / it

    def run_job(case, split, args, path, block, env):
        calls.append((case, path))
        r = sum(1 for c, _ in calls if c == case and _ == path) - 1
        return {"lean": [1.0] * 3, "mpipar": [1.0 / speed[path][r]] * 3}

    monkeypatch.setattr(lean_samejob, "run_job", run_job)
    args = types.SimpleNamespace(rounds=2)
    results, rows_ = lean_samejob.bench(["a", "b"], args, {"mpipar": "new", "baseline": "old"},
                                        lambda c: 1, lambda c: "", {})
    assert calls == [("a", "new"), ("a", "old"), ("b", "old"), ("b", "new"),
                     ("a", "old"), ("a", "new"), ("b", "new"), ("b", "old")]
    assert len(results["a"]) == 2
    cells = [c.strip() for c in rows_[0].strip("|").split("|")]
    # ratios to the lean loop 2 and 4 (median 3), the baseline's 1: mpipar / baseline 3
    assert cells[0] == "a" and cells[3:] == ["3.000", "2.000-4.000", "1.000", "3.000"]
