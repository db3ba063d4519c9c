"""A dump analysed rank by rank (``stream.load``, what ``mpipar analyze`` does) gives the
numbers of the dump loaded whole, and keeps only a residue of each rank's events."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from mpipar.analysis import breakdown, load
from mpipar.analysis.fit_parts import StreamedError
from mpipar.analysis.steps import StepChoice
from mpipar.analysis.stream import load as load_streamed

README_V1 = Path(__file__).parent / "data" / "readme_v1_steps0-5.h5"


def _same(a, b, where="") -> None:
    """``a`` and ``b`` equal value by value (NaN equals NaN), nested dicts, lists, arrays."""
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, np.ndarray):
        _same(a.tolist(), b.tolist(), where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def _synthetic(tmp_path, **kw) -> Path:
    from mpipar.analysis.synthetic_run import write_run

    path = tmp_path / "syn.h5"
    write_run(path, **kw)
    return path


@pytest.mark.parametrize("choice", [None, StepChoice(sample=3), StepChoice(step=3)])
def test_streamed_readme_dump_gives_the_whole_dumps_numbers(choice):
    step = choice.step if choice is not None else None
    whole = breakdown(load(README_V1, steps=choice), step=step)
    streamed_run = load_streamed(README_V1, steps=choice, step=step)
    _same(whole, breakdown(streamed_run, step=step))


def test_streamed_synthetic_dump_keeps_a_residue_only(tmp_path, monkeypatch):
    from mpipar.analysis import costmodel

    # p2p latency timed on 4 of the 39 steps (as a large run's is): the residue keeps those
    monkeypatch.setattr(costmodel, "LATENCY_RANK_STEPS", 64)
    path = _synthetic(tmp_path, dp=4, pp=4, tp=1, steps=40, schedule="1f1b", microbatches=4)
    run = load(path)
    whole = breakdown(run)
    streamed = load_streamed(path)
    _same(whole, breakdown(streamed))
    held = sum(len(ev) for ev in streamed.events)
    assert 0 < held < sum(len(ev) for ev in run.events) / 4
    # a step other than the one it was streamed for: one clear error, not other numbers
    with pytest.raises(ValueError, match="streamed for step None"):
        breakdown(streamed, step=5)


def test_a_piece_the_pass_did_not_make_is_an_error(tmp_path):
    from mpipar.analysis.predict import measured_costs

    run = load_streamed(_synthetic(tmp_path, dp=1, pp=2, tp=1, steps=6))
    with pytest.raises(StreamedError, match="not worked out in the streamed pass"):
        measured_costs(run, [2, 3])


def test_streamed_parts_layout_with_a_missing_part(tmp_path):
    from test_analysis_scale import _write_parts

    path = tmp_path / "trace.h5"
    _write_parts(path, 3, [0, 1, 2, 3], skip=(1,))
    whole, streamed = load(path), load_streamed(path)
    assert streamed.notes == whole.notes and streamed.notes  # rank 1's part is named
    _same(breakdown(whole), breakdown(streamed))
