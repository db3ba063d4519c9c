"""A continuous run's prediction takes each step's own unit costs (``CostModel.step_unit``).

A rank's pace drifts from step to step; in a pipeline that never drains, the rank that is slow
in one step stalls its neighbour in that step, which the run's mean costs (and a jitter taken
within each step) do not reproduce. Round trips on runs written by the step-at-a-time
simulation (``test_costmodel.continuous_dump``)."""

import pytest
from test_costmodel import continuous_dump

from mpipar.analysis.dump import load
from mpipar.parallel.pipeline.actions import Action, ScheduleError
from mpipar.parallel.pipeline.simulate import CostModel

PER_UNIT = {(0, 0, "F"): 1.0, (0, 0, "BW"): 2.0, (1, 1, "F"): 1.5, (1, 1, "BW"): 2.5,
            (0, 0, "UPDATE"): 0.25, (1, 1, "UPDATE"): 0.25}


def test_a_step_costs_its_own_units_where_given():
    model = CostModel(unit={}, per_unit=dict(PER_UNIT), microbatches=4,
                      step_unit={(1, 2, 1, "B"): 4.0, (0, 3, 0, "F"): 2.0}).check()
    # micro-batch 9 of the run-long lists is step 2's (m = 4); a whole backward (BW) is
    # recorded as one B
    assert model.compute(1, Action("BW", 9, 1), 1) == 4.0
    assert model.compute(1, Action("BW", 5, 1), 1) == 2.5  # step 1: the run's mean
    assert model.compute(0, Action("F", 12, 0), 1) == 2.0
    assert model.compute(0, Action("UPDATE", 12, 0), 1) == 0.25
    with pytest.raises(ScheduleError, match="microbatches"):
        CostModel(unit={}, per_unit=dict(PER_UNIT), step_unit={(0, 1, 0, "F"): 1.0}).check()
    with pytest.raises(ScheduleError, match="step_unit"):
        CostModel(unit={}, microbatches=2, step_unit={(0, 1, 0, "F"): -1.0}).check()


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
def test_each_steps_own_costs_are_fitted_and_predict_the_run(tmp_path, kind, monkeypatch):
    """Rank 1 slow in step 2, rank 0 in step 3: the fit finds each step's own costs, and bubble
    and step come out as made; the run's means alone predict it otherwise."""
    from mpipar.analysis import breakdown
    from mpipar.analysis import predict_continuous as pc

    m = 4
    slow = {(1, 2, 1, "BW"): 4.5, (1, 2, 1, "F"): 2.5, (0, 3, 0, "F"): 2.0,
            (0, 3, 0, "BW"): 3.5}
    model = CostModel(unit={}, per_unit=dict(PER_UNIT), latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3, step_unit=slow, microbatches=m)
    path, spans = continuous_dump(tmp_path / "cont.h5", model, kind=kind, m=m, steps=5)
    s = breakdown(path)["summary"]
    fitted = s["predicted"]["model"]
    assert fitted["step_unit_steps"] >= 3
    assert max(fitted["step_unit_cv"].values()) > 0.05
    assert s["step_time_pred"] == pytest.approx(s["step_time"])
    assert s["bubble_pred"] == pytest.approx(s["bubble_pipeline"]), s["predict_note"]
    # the same run on the run's mean costs: another bubble
    monkeypatch.setattr(pc, "step_unit_costs", lambda run, tags: {})
    plain = breakdown(path)["summary"]
    assert plain["bubble_pred"] != pytest.approx(s["bubble_pipeline"], abs=1e-3)


def test_each_calls_own_fixed_costs_are_fitted_and_predict_the_run(tmp_path, monkeypatch):
    """A stall inside one call (rank 0's call 2 runs with a larger overhead per action, rank 1's
    call 3 starts late, rank 0's lagged reduction takes long in call 1): each is found in its
    call (``CostModel.call_part``), and bubble and step come out as made; the ranks' medians
    over their calls predict it otherwise."""
    from mpipar.analysis import breakdown
    from mpipar.analysis import predict_continuous as pc

    parts = {(0, 2, "overhead"): 0.15, (1, 3, "step_pre"): 0.9, (0, 1, "sync"): 1.2}
    model = CostModel(unit={}, per_unit=dict(PER_UNIT), latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3, call_part=parts)
    path, spans = continuous_dump(tmp_path / "cont.h5", model, kind="pipedream", m=4, steps=5)
    s = breakdown(path)["summary"]
    assert s["predicted"]["model"]["call_parts"] == 8  # 2 ranks x the measured calls 1-4
    assert s["step_time_pred"] == pytest.approx(s["step_time"])
    assert s["bubble_pred"] == pytest.approx(s["bubble_pipeline"]), s["predict_note"]
    fitted = pc._model(load(path), [1, 2, 3, 4], "pipedream", 2, 4)[1]
    for (r, k, name), v in parts.items():
        assert fitted.call_part[(r, k, name)] == pytest.approx(v), (r, k, name)
    # the same run with only the ranks' medians: another bubble
    orig = pc.fit_continuous

    def medians_only(*args):
        got, notes = orig(*args)
        got.call_part = {}
        return got, notes

    monkeypatch.setattr(pc, "fit_continuous", medians_only)
    assert breakdown(path)["summary"]["bubble_pred"] != pytest.approx(s["bubble_pipeline"],
                                                                      abs=1e-3)
