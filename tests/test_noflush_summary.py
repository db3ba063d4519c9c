"""experiments/noflush_summary.py: each continuous run judged against its round's 1F1B run."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import noflush_summary  # noqa: E402


def _row(sched, bubble, tok_s, pipe=None, pred=None, rnd=1, cfg="tiny", m=4, wall=None):
    return {"round": rnd, "cfg": cfg, "m": m, "sched": sched, "bubble": bubble,
            "bubble_pipe": bubble if pipe is None else pipe,
            "bubble_pred": bubble if pred is None else pred, "tok_s": tok_s,
            "wall_tok_s": tok_s if wall is None else wall}


def test_a_continuous_run_meets_the_bar_only_on_all_three_counts():
    rows = [_row("1f1b", 0.28, 100.0),
            _row("pipedream-2bw-cont", 0.15, 115.0, pipe=0.153, pred=0.145),  # meets
            _row("pipedream-cont", 0.21, 104.0),  # tokens/s only 4 % above
            _row("pipedream-cont", 0.26, 110.0, m=4, rnd=1, cfg="tiny"),  # bubble 2 points
            _row("pipedream-2bw-cont", 0.15, 115.0, pipe=0.153, pred=0.12),  # prediction off
            _row("pipedream-2bw-cont", 0.10, 200.0, rnd=2),  # no 1F1B in its round: no verdict
            _row("pipedream-2bw-cont", 0.15, 115.0, wall=103.0)]  # per step 15 %, wall 3 %
    noflush_summary.verdicts(rows)
    assert [r.get("ok") for r in rows] == [None, True, False, False, False, None, False]
    assert abs(rows[1]["d_bubble"] + 0.13) < 1e-12 and abs(rows[1]["speedup"] - 0.15) < 1e-12


def test_the_folder_is_read_by_run_name(tmp_path, capsys):
    (tmp_path / "r1_tiny_m4_1f1b").mkdir()  # no dump inside: skipped, not a crash
    (tmp_path / "pattern.h5").write_bytes(b"")
    assert noflush_summary.rows(tmp_path) == []
    noflush_summary.main(tmp_path)
    assert "speedup" in capsys.readouterr().out


def test_the_figure_takes_medians_over_rounds_and_writes_a_png(tmp_path):
    import noflush_figure

    rows = [_row("1f1b", b, 100.0, pred=p, rnd=k, m=m)
            for k, (b, p) in enumerate([(0.30, 0.28), (0.20, 0.21), (0.25, 0.22)], 1)
            for m in (2, 4)]
    rows += [_row("pipedream-cont", 0.10, 120.0, pred=float("nan"), m=4)]
    cur = noflush_figure.curves(rows)
    assert cur["tiny"]["1f1b"] == [(2, 0.25, 0.22), (4, 0.25, 0.22)]
    m, meas, pred = cur["tiny"]["pipedream-cont"][0]
    assert (m, meas) == (4, 0.10) and pred != pred  # no prediction: NaN, not a crash
    assert "pipedream-cont" in noflush_figure.table(cur)
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    noflush_figure.draw(cur, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_says_what_to_run_on_an_empty_folder(tmp_path):
    import noflush_figure

    with pytest.raises(SystemExit, match="noflush_ab.sh"):
        noflush_figure.main(tmp_path, tmp_path / "f.png")


def test_the_gaps_table_puts_each_term_beside_its_simulation(tmp_path):
    """On a continuous run written by the simulation itself (known costs, stashes on the first
    stage, long enough that the last waits for it), every measured term of noflush_gaps.py
    equals its simulated one."""
    import noflush_gaps
    from test_costmodel import continuous_dump

    from mpipar.analysis import load
    from mpipar.parallel.pipeline.simulate import CostModel

    per_unit = {(0, 0, "F"): 1.0, (0, 0, "BW"): 2.0, (1, 1, "F"): 1.5, (1, 1, "BW"): 2.5,
                (0, 0, "UPDATE"): 0.25, (1, 1, "UPDATE"): 0.25}
    model = CostModel(unit={}, per_unit=per_unit, latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3, stash={(0, 0, "F"): 1.0, (0, 0, "BW"): 0.2})
    (tmp_path / "r1").mkdir()
    continuous_dump(tmp_path / "r1" / "trace.h5", model, kind="pipedream", m=4, steps=5)
    run = load(str(tmp_path / "r1" / "trace.h5"))
    steps = [1, 2, 3, 4]
    meas, sim = noflush_gaps.measured(run, steps), noflush_gaps.simulated(run, steps,
                                                                          "pipedream", 2, 4)
    for key in sim:
        if key[1] != "uncovered":  # (the sim's includes send and receive posting)
            assert np.mean(meas[key]) == pytest.approx(np.mean(sim[key]), abs=1e-9), key
    assert np.mean(meas[(0, "stash")]) > 0 and np.mean(meas[(1, "wait for activations")]) > 0
    text = noflush_gaps.report(tmp_path / "r1")
    assert "wait for gradients" in text and "longest stalls" in text


def test_feasibility_names_the_terms_a_continuous_run_pays_beyond_1f1b(tmp_path):
    """A continuous PipeDream run written by the simulation (weight-version work before each
    forward of the first stage, an update per micro-batch) against a 1F1B dump: the stash and
    update terms are what the continuous period drops by without them, the gains are finite,
    and taking every term at 1F1B's value gains at least as much as the fitted costs do."""
    import noflush_feasible
    from test_costmodel import continuous_dump

    from mpipar.analysis.synthetic_run import write_run
    from mpipar.parallel.pipeline.simulate import CostModel

    per_unit = {(0, 0, "F"): 1.0, (0, 0, "BW"): 2.0, (1, 1, "F"): 1.5, (1, 1, "BW"): 2.5,
                (0, 0, "UPDATE"): 0.25, (1, 1, "UPDATE"): 0.25}
    model = CostModel(unit={}, per_unit=per_unit, latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3, stash={(0, 0, "F"): 1.0, (0, 0, "BW"): 0.2})
    cont, ref = tmp_path / "r1_tiny_m4_pipedream-cont", tmp_path / "r1_tiny_m4_1f1b"
    cont.mkdir()
    ref.mkdir()
    continuous_dump(cont / "trace.h5", model, kind="pipedream", m=4, steps=5)
    write_run(ref / "trace.h5", steps=5, microbatches=4)
    got = noflush_feasible.feasibility(cont, ref)
    assert set(got) == {"pred", "no_ovh", "bound", "imbal", *noflush_feasible.TERMS}
    assert all(np.isfinite(v) for v in got.values())
    # the first stage's stash (4 x 1.2 per step) delays its sends: the period drops without it
    assert 0 < got["stash"] <= 1e3 * 4 * 1.2 + 1e-6
    assert got["bound"] >= got["pred"]
    lines = noflush_feasible.table([{"round": 1, "cfg": "tiny", "m": 4,
                                     "sched": "pipedream-cont", "wall_speedup": 0.1,
                                     "feasible": got}, {"round": 1, "sched": "1f1b"}])
    assert len(lines) == 3 and lines[2].startswith("r1_tiny_m4_pipedream-cont")
