"""Cost-model simulation: bubble fractions against the published formulas, peak activations."""

import pytest

from mpipar.parallel.pipeline.actions import ScheduleError
from mpipar.parallel.pipeline.chart import text_chart
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.simulate import resolve_costs, simulate, textbook_bubble

PP_M = [(pp, m) for pp in range(1, 9) for m in sorted({1, 2, pp, pp + 1, 2 * pp + 3, 4 * pp})]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble_is_textbook(kind):
    for pp, m in PP_M:
        r = simulate(build_schedule(kind, pp, m))  # F = 1, BW = 2
        assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
        assert r.makespan == pytest.approx(3 * (m + pp - 1))
        assert textbook_bubble(kind, pp, m) == pytest.approx((pp - 1) / (m + pp - 1))


def test_naive_bubble():
    for pp in range(1, 9):
        r = simulate(build_schedule("naive", pp, 1))
        assert r.bubble_fraction == pytest.approx((pp - 1) / pp, abs=1e-12)
        assert r.peak_activations == [1] * pp


def test_interleaved_bubble_is_textbook():
    for pp in range(1, 9):
        for v in (2, 3, 4):
            for m in (pp, 2 * pp, 3 * pp):
                r = simulate(build_schedule("interleaved", pp, m, v))
                tb = (pp - 1) / (v * m + pp - 1)
                assert r.bubble_fraction == pytest.approx(tb, abs=1e-12), (pp, v, m)
                assert textbook_bubble("interleaved", pp, m, v) == pytest.approx(tb)


def test_zb_h1_beats_1f1b_at_the_same_peak_memory():
    for pp, m in PP_M:
        if pp == 1:
            continue
        zb = simulate(build_schedule("zb-h1", pp, m), {"F": 1, "B": 1, "W": 1})
        one = simulate(build_schedule("1f1b", pp, m), {"F": 1, "B": 1, "W": 1})
        assert zb.bubble_fraction < one.bubble_fraction
        assert max(zb.peak_activations) == max(one.peak_activations) == min(pp, m)
        if m >= pp:  # Qi et al.: idle (p-1) per rank instead of 3(p-1)
            assert zb.makespan == pytest.approx(3 * m + pp - 1)
            assert zb.bubble_fraction == pytest.approx(textbook_bubble("zb-h1", pp, m))


def test_peak_activations():
    for pp, m in PP_M:
        g = simulate(build_schedule("gpipe", pp, m))
        assert g.peak_activations == [m] * pp
        o = simulate(build_schedule("1f1b", pp, m))
        assert o.peak_activations[0] == min(pp, m)
        assert o.peak_activations == [min(pp - r, m) for r in range(pp)]
    r = simulate(build_schedule("interleaved", 2, 4, 2))
    assert max(r.peak_activations) <= 2 * 4  # chunks x micro-batches, never more than all


def test_costs_scale_and_comm_delays():
    s = build_schedule("1f1b", 4, 8)
    base = simulate(s)
    double = simulate(s, {"F": 2, "BW": 4})
    assert double.makespan == pytest.approx(2 * base.makespan)
    assert double.bubble_fraction == pytest.approx(base.bubble_fraction)
    slow = simulate(s, {"comm": 0.25})
    assert slow.makespan > base.makespan
    assert resolve_costs({"B": 1.5, "W": 0.5})["BW"] == 2.0  # BW follows B + W unless given
    with pytest.raises(ScheduleError, match="unknown cost name"):
        simulate(s, {"X": 1})
    with pytest.raises(ScheduleError, match=">= 0"):
        simulate(s, {"F": -1})


def test_pipedream_simulates_and_has_no_textbook_flush_bubble():
    r = simulate(build_schedule("pipedream", 4, 8), {"UPDATE": 0.5})
    assert r.makespan > 0 and textbook_bubble("pipedream", 4, 8) is None
    assert r.busy[0] == pytest.approx(8 * 3 + 8 * 0.5)


def test_timeline_is_consistent():
    s = build_schedule("zb-h1", 3, 5)
    r = simulate(s)
    for row, acts in zip(r.timeline, s.ranks, strict=True):
        assert [a for _, _, a in row] == acts
        for (s0, e0, _), (s1, _, _) in zip(row, row[1:], strict=False):
            assert s0 <= e0 <= s1 + 1e-12


def test_text_chart_rows_and_columns():
    s = build_schedule("gpipe", 3, 4)
    chart = text_chart(simulate(s), s)
    rows = [line for line in chart.splitlines() if line.lstrip().startswith("rank")]
    assert len(rows) == 3
    assert rows[0].split(":")[1].split()[:4] == ["F0", "F1", "F2", "F3"]
    assert len(rows[2].split(":")[1].split()) == 3 * (4 + 3 - 1)  # makespan columns
    s = build_schedule("1f1b", 8, 32)
    assert all(len(line) <= 120 for line in text_chart(simulate(s), s).splitlines())


# --- the calibrated cost model -----------------------------------------------------------------

def test_cost_model_defaults_match_the_plain_costs():
    from mpipar.parallel.pipeline.simulate import CostModel

    for kind, pp, m in (("1f1b", 4, 8), ("gpipe", 3, 5), ("zb-h1", 2, 4)):
        s = build_schedule(kind, pp, m)
        a, b = simulate(s), simulate(s, CostModel())
        assert a.makespan == b.makespan and a.bubble_fraction == b.bubble_fraction
        assert b.step_time == pytest.approx(a.makespan)


def test_cost_model_by_hand():
    """gpipe pp=2 m=1: F0 (r0), F1 (r1), BW1 (r1), BW0 (r0), one message each way."""
    from mpipar.parallel.pipeline.simulate import CostModel

    s = build_schedule("gpipe", 2, 1)
    # a slow last stage: F on (rank 1, chunk 1) costs 3 instead of 1
    slow = simulate(s, CostModel(per_unit={(1, 1, "F"): 3.0}))
    assert slow.makespan == pytest.approx(1 + 3 + 2 + 2)
    assert slow.busy == pytest.approx([3.0, 5.0])
    # latency 0.5 + 100 bytes at 100 bytes/s: each message takes 1.5
    wire = simulate(s, CostModel(latency=0.5, default_bytes=100, bandwidth=100))
    assert wire.makespan == pytest.approx(1 + 1.5 + 1 + 2 + 1.5 + 2)
    # per-action overhead after every action, posting costs on sends and receives
    over = simulate(s, CostModel(overhead=0.1, send_post=0.2, recv_post=0.05))
    # r0: F0 [0, 1] +.1, SEND [1.1, 1.3] (message there at 1.3); r1: RECV to 1.35 +.1,
    # F1 [1.45, 2.45] +.1, BW1 [2.55, 4.55] +.1, SEND [4.65, 4.85]; r0: RECV to 4.9 +.1, BW0 2 +.1
    assert over.makespan == pytest.approx(4.85 + 0.05 + 0.1 + 2 + 0.1)
    assert over.overhead == pytest.approx([0.4, 0.4])
    # dp reductions after each chunk's last weight pass, the norm collective, optimizer, fixed
    full = simulate(s, CostModel(dp_reduce={(0, 0): 1.0, (1, 1): 1.0}, sync=0.25,
                                 optimizer={0: 0.3, 1: 0.6}, step_pre=0.5, step_post=0.1))
    assert full.pipeline_end == pytest.approx([0.5 + 6 + 1, 0.5 + 4 + 1])
    assert full.step_time == pytest.approx(0.5 + 6 + 1 + 0.25 + 0.6 + 0.1)
    assert full.dp_timeline[1] == [(pytest.approx(4.5), pytest.approx(5.5), 1)]
    assert full.step_bubble == pytest.approx(1 - 3 / full.step_time)
    # waits in the step's collectives count as communication (as a dump counts them)
    # r0: waits 3 for RECV_B, dp 1, the norm 0.25, the slower optimizer 0.3;
    # r1: waits 1 for RECV_F, dp 1, the norm 7.75 - 5.5
    assert full.comm == pytest.approx([3 + 1 + 0.25 + 0.3, 1 + 1 + 2.25])


def test_cost_model_errors():
    from mpipar.parallel.pipeline.simulate import CostModel

    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="overhead must be a number >= 0"):
        simulate(s, CostModel(overhead=-1.0))
    with pytest.raises(ScheduleError, match="bandwidth must be > 0"):
        simulate(s, CostModel(bandwidth=0.0))
    with pytest.raises(ScheduleError, match=r"cost \(0, 0, 'F'\)"):
        simulate(s, CostModel(per_unit={(0, 0, "F"): -2.0}))


def test_compute_jitter_raises_the_expected_step_and_is_deterministic():
    """A receive waits for the later of its rank and its sender, so a step is a max-plus function
    of its units' durations: with durations spread around their costs (mean 1) the mean step is
    longer than the step of the costs, the more so the more micro-batches meet."""
    import numpy as np

    from mpipar.parallel.pipeline.simulate import CostModel

    def mean_gap(m):
        s = build_schedule("1f1b", 2, m)
        plain = simulate(s, CostModel(latency=0.01)).makespan
        model = CostModel(latency=0.01, jitter=(0.7, 1.0, 1.3))
        draws = [simulate(s, model, draw=k).makespan for k in range(64)]
        assert simulate(s, model, draw=3).makespan == draws[3]  # seeded: the same each time
        return float(np.mean(draws)) / plain - 1

    assert 0 < mean_gap(2) < mean_gap(8)
    s = build_schedule("1f1b", 2, 4)
    flat = CostModel(latency=0.01, jitter=(1.0, 1.0))
    assert simulate(s, flat, draw=0).makespan == pytest.approx(simulate(s, flat).makespan)
    with pytest.raises(ScheduleError, match="jitter"):
        simulate(s, CostModel(jitter=(1.0, -0.5)), draw=0)


def test_a_continuous_schedule_run_a_step_at_a_time_never_meets_between_steps():
    """simulate_steps: each rank runs its calls back to back (its share of the lagged
    reduction, sync, and the fixed time after and before on its own clock): rank r's call
    k + 1 starts when its call k ends, whatever the other rank is doing; the spans add up."""
    from mpipar.parallel.pipeline.actions import step_cuts
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import CostModel, simulate_steps

    s = lower(build_schedule("pipedream-2bw", 2, 2, steps=3))
    order = s.ranks  # the executor's order
    cuts = [step_cuts(s, a) for a in order]
    model = CostModel(sync=0.5, step_pre=0.25, step_post=0.125)
    sim, spans = simulate_steps(s, model, order, cuts)
    assert [len(sp) for sp in spans] == [3, 3]
    for r, tl in enumerate(sim.timeline):
        start = 0.0
        for k, span in enumerate(spans[r]):
            call = tl[(cuts[r][k - 1] if k else 0):cuts[r][k]]
            assert call[0][0] >= start + 0.25 - 1e-12
            assert span == pytest.approx(call[-1][1] + 0.5 + 0.125 - start)
            start += span
    # no meeting: the ranks' calls of one step end at different times (rank 0 runs the next
    # step's first forward in its call)
    assert spans[0][0] != pytest.approx(spans[1][0])
    free = simulate(s)  # no barriers: the lists flow on, so they end sooner
    assert free.makespan < sim.makespan


def test_a_ranks_own_terms_stash_and_jitter_apply_to_it_alone():
    """CostModel.per_rank, stash and rank_jitter: rank 0's own gap between calls, the
    weight-version work before its forwards (before the compute, not part of it) and its own
    jitter; rank 1 keeps the values for every rank and runs its units at their costs."""
    from mpipar.parallel.pipeline.actions import step_cuts
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import CostModel, simulate_steps

    s = lower(build_schedule("pipedream", 2, 2, steps=3))
    order = s.ranks
    cuts = [step_cuts(s, a) for a in order]
    unit = {"F": 1.0, "BW": 2.0, "UPDATE": 0.5}
    base = CostModel(unit=dict(unit), step_gap=0.25)
    model = CostModel(unit=dict(unit), step_gap=0.25, per_rank={(0, "step_gap"): 1.0},
                      stash={(0, 0, "F"): 0.3}, jitter=(1.0,), rank_jitter={0: (0.5, 1.5)})
    (_, b_spans), (sim, spans) = (simulate_steps(s, base, order, cuts),
                                  simulate_steps(s, model, order, cuts, draw=3))
    for r, tl in enumerate(sim.timeline):
        got = [b - a for a, b, act in tl if act.op in unit]
        want = [unit[act.op] for _, _, act in tl if act.op in unit]
        if r == 1:
            assert got == pytest.approx(want)  # its own pool (none): the costs as given
        else:
            assert got != pytest.approx(want)  # drawn from (0.5, 1.5)
            assert {round(g / w, 9) for g, w in zip(got, want)} <= {0.5, 1.5}
    # rank 0's forwards start 0.3 after the action before them (the stash, not compute), and
    # its calls its own gap (1.0) after the previous one's last action; rank 1's the common 0.25
    tl0 = sim.timeline[0]
    lead = [a1 - b0 for (_, b0, _), (a1, _, q) in zip(tl0, tl0[1:]) if q.op == "F"]
    assert min(lead) == pytest.approx(0.3)
    for r, gap in ((0, 1.0), (1, 0.25)):
        tl = sim.timeline[r]
        for k in (1, 2):
            assert tl[cuts[r][k - 1]][0] - tl[cuts[r][k - 1] - 1][1] >= gap - 1e-12
    assert sim.busy[0] == pytest.approx(sum(b - a for a, b, act in tl0 if act.op in unit))
    assert sum(spans[0]) > sum(b_spans[0])


def test_textbook_bubble_is_the_makespan_form_of_its_one_home():
    """simulate.textbook_bubble and plan.pipeline.closed_form are formulas' functions: the
    bubble is 1 - m (f+b+w) / makespan at f = b = w = 1, the same figure either way."""
    from mpipar.parallel.pipeline import formulas
    from mpipar.plan.pipeline import closed_form

    assert textbook_bubble is formulas.textbook_bubble
    for kind, p, m, v in (("gpipe", 4, 8, 1), ("1f1b", 3, 6, 1), ("interleaved", 4, 8, 2),
                          ("zb-h1", 4, 4, 1), ("naive", 4, 1, 1)):
        span = closed_form(kind, p, m, v, 1.0, 1.0, 1.0)
        assert textbook_bubble(kind, p, m, v) == pytest.approx(1 - 3 * m / span, abs=1e-12)
    assert textbook_bubble("interleaved", 4, 6, 2) == pytest.approx(3 / 15)  # any m, published
    assert closed_form("interleaved", 4, 6, 2, 1, 1, 1) is None  # not exact in the simulator
