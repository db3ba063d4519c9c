"""The cost model's fit from dump events (mpipar.analysis.costmodel), on hand-made dumps whose
right answer is known."""

import pytest

from mpipar.analysis.dump import load
from mpipar.analysis.synthetic import ev, write
from mpipar.parallel.pipeline.generators import build_schedule

LATENCY, OFFSET = 0.3, 5.0  # true p2p latency; rank 1's clock reads true time + OFFSET


def one_f_one_b_step():
    """One 1F1B step at pp = 2, m = 2, true times, every message taking LATENCY.

    Rank 0 finds its send of F0 complete (a ``test`` between actions records a zero-length
    ``pp.wait`` mb 0 chunk 0 peer 1) at 2.25, before rank 1 even sends the gradient of mb 0
    (4.4), and then waits for that gradient under the same (mb, chunk, peer): the first wait is
    not a receive. Its send of F1 completes at the end of the step (outside the receive's window).
    """
    r0 = [ev("STEP", 0, 0.0, 10.0),
          ev("pp.recv", 0, 0.0, 0.01, mb=0, chunk=0, nbytes=64, peer=1),
          ev("pp.recv", 0, 0.01, 0.02, mb=1, chunk=0, nbytes=64, peer=1),
          ev("F", 0, 0.1, 1.1, mb=0, chunk=0),
          ev("pp.send", 0, 1.1, 1.12, mb=0, chunk=0, nbytes=64, peer=1),
          ev("F", 0, 1.2, 2.2, mb=1, chunk=0),
          ev("pp.send", 0, 2.2, 2.22, mb=1, chunk=0, nbytes=64, peer=1),
          ev("pp.wait", 0, 2.25, 2.25, mb=0, chunk=0, nbytes=64, peer=1),  # send F0 done
          ev("pp.wait", 0, 2.3, 4.4 + LATENCY, mb=0, chunk=0, nbytes=64, peer=1),  # grad 0
          ev("B", 0, 4.7, 6.7, mb=0, chunk=0),
          ev("pp.wait", 0, 6.73, 7.45 + LATENCY, mb=1, chunk=0, nbytes=64, peer=1),  # grad 1
          ev("B", 0, 7.75, 9.75, mb=1, chunk=0),
          ev("pp.wait", 0, 9.76, 9.76, mb=1, chunk=0, nbytes=64, peer=1),  # send F1 done
          ev("OPT", 0, 9.8, 10.0)]
    r1 = [ev("STEP", 0, 0.0, 10.0),
          ev("pp.recv", 0, 0.0, 0.01, mb=0, chunk=1, nbytes=64, peer=0),
          ev("pp.recv", 0, 0.01, 0.02, mb=1, chunk=1, nbytes=64, peer=0),
          ev("pp.wait", 0, 0.03, 1.1 + LATENCY, mb=0, chunk=1, nbytes=64, peer=0),  # act 0
          ev("F", 0, 1.4, 2.4, mb=0, chunk=1),
          ev("B", 0, 2.4, 4.4, mb=0, chunk=1),
          ev("pp.send", 0, 4.4, 4.42, mb=0, chunk=1, nbytes=64, peer=0),
          ev("pp.wait", 0, 4.42, 4.43, mb=1, chunk=1, nbytes=64, peer=0),  # act 1, long there
          ev("F", 0, 4.45, 5.45, mb=1, chunk=1),
          ev("B", 0, 5.45, 7.45, mb=1, chunk=1),
          ev("pp.send", 0, 7.45, 7.47, mb=1, chunk=1, nbytes=64, peer=0),
          ev("pp.wait", 0, 7.5, 7.5, mb=0, chunk=1, nbytes=64, peer=0),
          ev("pp.wait", 0, 7.5, 7.51, mb=1, chunk=1, nbytes=64, peer=0),
          ev("OPT", 0, 9.8, 10.0)]
    r1 = [(k, s, mb, c, start + OFFSET, end + OFFSET, nb, peer)
          for (k, s, mb, c, start, end, nb, peer) in r1]
    return [r0, r1]


@pytest.fixture
def skewed(tmp_path):
    return load(write(tmp_path / "skewed.h5", one_f_one_b_step(), {"dp": 1, "pp": 2, "tp": 1}))


def test_receives_are_matched_to_their_own_sends(skewed):
    from mpipar.analysis.costmodel import _received

    sched = build_schedule("1f1b", 2, 2)
    # rank 0: the wait for gradient 0 cannot be told from the send's completion (both lie after
    # F0 and before B0): dropped; gradient 1's is the only wait of its key before B1
    assert _received(skewed.events[0], 0, sched, skewed.coords) == [
        (pytest.approx(7.45 + LATENCY), 1, 1, 1, "SEND_B")]
    # rank 1: both activations (a send's completion never precedes its post)
    got = sorted(_received(skewed.events[1], 1, sched, skewed.coords))
    assert got == [(pytest.approx(1.1 + LATENCY + OFFSET), 0, 0, 0, "SEND_F"),
                   (pytest.approx(4.43 + OFFSET), 0, 1, 0, "SEND_F")]


def test_latency_fit_cancels_the_clock_offset(skewed):
    from mpipar.analysis.costmodel import fit, transfer_times

    sched = build_schedule("1f1b", 2, 2)
    # pairing the send's completion at 2.25 with gradient 0's send (4.4 + OFFSET) gave
    # (5.3 - 7.15) / 2 < 0, clipped to 0
    assert transfer_times(skewed, [0], sched) == [pytest.approx(LATENCY)]
    model, notes = fit(skewed, [0], sched)
    assert model.latency == pytest.approx(LATENCY) and notes == []


def replica_events(f, b, wait, steps=2, reduce=0.5, opt=0.5, step_len=10.0):
    """One data-parallel replica of GPipe at pp = 1, m = 2: F F B B from 0, its gradient
    reduction (``wait`` for the other replica, then ``reduce``), the optimizer, to ``step_len``."""
    return replica_steps([(f, b, wait)] * steps, reduce, opt, step_len)


def replica_steps(plan, reduce=0.5, opt=0.5, step_len=10.0):
    """``replica_events`` with its own (f, b, wait) in each step."""
    rows = []
    for s, (f, b, wait) in enumerate(plan):
        t0 = s * step_len
        end = t0 + 2 * (f + b)
        rows += [ev("STEP", s, t0, t0 + step_len),
                 ev("F", s, t0, t0 + f, mb=0, chunk=0),
                 ev("F", s, t0 + f, t0 + 2 * f, mb=1, chunk=0),
                 ev("B", s, t0 + 2 * f, t0 + 2 * f + b, mb=0, chunk=0),
                 ev("B", s, t0 + 2 * f + b, end, mb=1, chunk=0),
                 ev("dp.allreduce", s, end, end + wait + reduce, nbytes=1 << 20),
                 ev("OPT", s, end + wait + reduce, end + wait + reduce + opt)]
    return rows


def test_data_parallel_replicas_are_simulated_each(tmp_path):
    """Replica 1 computes 9 s a step, replica 0 6 s and then waits 3 s in the reduction: the
    pipeline window (0 to 9) holds replica 0's wait, measured and predicted alike."""
    from mpipar.analysis import breakdown
    from mpipar.analysis.synthetic import gpt_config

    events = [replica_events(1.0, 2.0, wait=3.0), replica_events(1.5, 3.0, wait=0.0)]
    path = write(tmp_path / "dp2.h5", events, {"dp": 2, "pp": 1, "tp": 1},
                 config=gpt_config(microbatches=2, schedule="gpipe"))
    s = breakdown(path)["summary"]
    assert s["bubble_pipeline"] == pytest.approx((1 - 6 / 9) / 2)
    assert s["bubble_pred"] == pytest.approx((1 - 6 / 9) / 2), s["predict_note"]
    # reduction 0.5 after the slower replica (9.5), optimizer 0.5: 10 s, as measured
    assert s["step_time_pred"] == pytest.approx(10.0) and s["step_time"] == pytest.approx(10.0)
    assert s["predicted"]["replicas"] == 2
    assert s["predicted"]["compute"] == [pytest.approx(7.5)]


def test_tensor_parallel_ranks_are_simulated_each(tmp_path):
    """tp rank 1 starts 0.5 s late; rank 0's first F waits for it inside the F (a tp collective
    is part of the unit). Window 0 to 6.5: rank 1 idles 0.5 of it, measured and predicted."""
    from mpipar.analysis import breakdown
    from mpipar.analysis.synthetic import gpt_config

    def rank(f0_start):
        rows = []
        for s in range(2):
            t = 10.0 * s
            rows += [ev("STEP", s, t, t + 7.0), ev("F", s, t + f0_start, t + 1.5, mb=0, chunk=0),
                     ev("F", s, t + 1.5, t + 2.5, mb=1, chunk=0),
                     ev("B", s, t + 2.5, t + 4.5, mb=0, chunk=0),
                     ev("B", s, t + 4.5, t + 6.5, mb=1, chunk=0), ev("OPT", s, t + 6.5, t + 7.0)]
        return rows

    path = write(tmp_path / "tp2.h5", [rank(0.0), rank(0.5)], {"dp": 1, "pp": 1, "tp": 2},
                 config=gpt_config(microbatches=2, schedule="gpipe"))
    s = breakdown(path)["summary"]
    assert s["bubble_pipeline"] == pytest.approx(0.5 / 6.5 / 2)
    # rank 0's two F differ (1.5, 1.0): the prediction draws that spread for every F (alike on
    # both tp ranks), so it is near, not exactly, the mean-cost answer
    assert s["bubble_pred"] == pytest.approx(0.5 / 6.5 / 2, abs=2e-3), s["predict_note"]
    assert s["step_time_pred"] == pytest.approx(7.0, rel=2e-2)


def test_sends_of_one_chunk_to_one_peer_are_told_apart_by_order(tmp_path):
    """Interleaved pp = 2, v = 2: chunk 2 sends micro-batch 0's activation (to chunk 3) and its
    gradient (to chunk 1), both to rank 1 with the same (mb, chunk, peer); the activation first."""
    from mpipar.analysis.costmodel import _send_starts

    r0 = [ev("STEP", 0, 0.0, 5.0),
          ev("pp.send", 0, 3.0, 3.1, mb=0, chunk=2, nbytes=64, peer=1),
          ev("pp.send", 0, 0.5, 0.6, mb=0, chunk=0, nbytes=64, peer=1),
          ev("pp.send", 0, 1.0, 1.1, mb=0, chunk=2, nbytes=64, peer=1)]
    r1 = [ev("STEP", 0, 0.0, 5.0)]
    run = load(write(tmp_path / "v2.h5", [r0, r1], {"dp": 1, "pp": 2, "tp": 1},
                     config=None))
    sched = build_schedule("interleaved", 2, 2, virtual_stages=2)
    assert _send_starts(run, [0], sched) == {
        (0, 0, 1, 0, 0, "SEND_F"): 0.5, (0, 0, 1, 0, 2, "SEND_F"): 1.0,
        (0, 0, 1, 0, 2, "SEND_B"): 3.0}


def test_replicas_taking_turns_as_the_straggler_are_predicted_step_by_step(tmp_path):
    """Step 1: replica 0 is the slow one (9 s of compute against 6), step 2: replica 1. On costs
    averaged over the steps the replicas are equal (no bubble); each step has one that waits,
    and the prediction, step by step like the measurement, shows it."""
    from mpipar.analysis import breakdown
    from mpipar.analysis.synthetic import gpt_config

    slow, fast = (1.5, 3.0, 0.0), (1.0, 2.0, 3.0)
    events = [replica_steps([fast, slow, fast]), replica_steps([fast, fast, slow])]
    path = write(tmp_path / "turns.h5", events, {"dp": 2, "pp": 1, "tp": 1},
                 config=gpt_config(microbatches=2, schedule="gpipe"))
    s = breakdown(path)["summary"]
    assert s["bubble_pipeline"] == pytest.approx((1 - 6 / 9) / 2)
    assert s["bubble_pred"] == pytest.approx((1 - 6 / 9) / 2), s["predict_note"]
    assert s["predicted"]["mean_costs"]["bubble"] == pytest.approx(0.0, abs=1e-12)
    assert s["step_time_pred"] == pytest.approx(10.0)


def test_whole_and_split_backwards_of_one_chunk_are_costed_apart(tmp_path):
    """DualPipeV runs both B (input gradient only) and BW (input and weight gradients) on one
    chunk; the dump records each as a ``B`` event. Each kind gets its own cost, not their mean;
    a chunk with one kind keeps B = BW. The spread of the durations within a kind is the
    jitter: none here, so none is fitted."""
    from mpipar.analysis.costmodel import jitter, unit_costs

    sched = build_schedule("dualpipev", 2, 4, virtual_stages=2)
    rows = {0: [ev("STEP", 0, 0.0, 100.0)], 1: [ev("STEP", 0, 0.0, 100.0)]}
    t = {0: 0.0, 1: 0.0}
    for p, acts in enumerate(sched.ranks):
        for a in acts:
            dur = {"F": 1.0, "B": 2.0, "BW": 3.0, "W": 1.0}.get(a.op)
            if dur is not None:
                kind = "B" if a.op == "BW" else a.op
                rows[p].append(ev(kind, 0, t[p], t[p] + dur, mb=a.mb, chunk=a.chunk))
                t[p] += dur
    run = load(write(tmp_path / "dpv.h5", [rows[0], rows[1]], {"dp": 1, "pp": 2, "tp": 1},
                     config=None))
    costs = unit_costs(run, [0], sched)
    assert costs[(0, 0, "B")] == pytest.approx(2.0) and costs[(0, 0, "BW")] == pytest.approx(3.0)
    assert costs[(1, 1, "B")] == pytest.approx(2.0) and costs[(1, 1, "BW")] == pytest.approx(3.0)
    assert jitter(run, [0], sched) == pytest.approx((1.0,) * len(jitter(run, [0], sched)))
    # without the schedule the two kinds are one mean (the model before)
    assert 2.0 < unit_costs(run, [0])[(0, 0, "B")] < 3.0


def test_jitter_is_the_spread_within_a_step_with_mean_one(tmp_path):
    """Two F of 1 and 3 s in step 0, two of 10 s in step 1: ratios 0.5, 1.5, 1, 1 (each step
    against its own mean: step-to-step drift is not jitter); m = 1 has none to fit."""
    from mpipar.analysis.costmodel import jitter

    r0 = [ev("STEP", 0, 0.0, 5.0), ev("F", 0, 0.0, 1.0, mb=0, chunk=0),
          ev("F", 0, 1.0, 4.0, mb=1, chunk=0),
          ev("STEP", 1, 10.0, 31.0), ev("F", 1, 10.0, 20.0, mb=0, chunk=0),
          ev("F", 1, 20.0, 30.0, mb=1, chunk=0)]
    run = load(write(tmp_path / "j.h5", [r0], {"dp": 1, "pp": 1, "tp": 1}, config=None))
    q = jitter(run, [0, 1])
    assert sum(q) / len(q) == pytest.approx(1.0)
    assert sorted(set(q)) == pytest.approx([0.5, 1.0, 1.5])
    assert [q.count(x) for x in (0.5, 1.0, 1.5)] == [len(q) // 4, len(q) // 2, len(q) // 4]
    assert jitter(run, [0]) != () and jitter(run, [1]) == pytest.approx((1.0,) * len(q))
    one = [ev("STEP", 0, 0.0, 5.0), ev("F", 0, 0.0, 1.0, mb=0, chunk=0)]
    assert jitter(load(write(tmp_path / "one.h5", [one], {"dp": 1, "pp": 1, "tp": 1},
                             config=None)), [0]) == ()


def continuous_dump(path, model, kind="pipedream-2bw", pp=2, m=2, steps=4):
    """A continuous run written from ``simulate_steps`` on ``model``: what the executor would
    record (each rank's call k between its own STEP markers, each action's event tagged with
    the step of its micro-batch, UPDATE as OPT, the rank's post and read of the lagged loss
    reduction). Returns (path, spans: per rank, per call)."""
    from mpipar.analysis.synthetic import gpt_config
    from mpipar.parallel.pipeline.actions import step_cuts
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import simulate_steps

    s = lower(build_schedule(kind, pp, m, steps=steps))
    order = s.ranks  # the executor's order
    cuts = [step_cuts(s, a) for a in order]
    sim, spans = simulate_steps(s, model, order, cuts)
    names = {"F": "F", "BW": "B", "UPDATE": "OPT", "SEND_F": "pp.send", "SEND_B": "pp.send",
             "RECV_F": "pp.wait", "RECV_B": "pp.wait"}
    rows = []
    for r, tl in enumerate(sim.timeline):
        mine = []
        gaps = [model.call_gap.get((r, k), model.of("step_gap", r)) for k in range(steps)]
        starts = [sum(spans[r][:k]) + sum(gaps[:k]) for k in range(steps)]
        for k in range(steps):
            lo, hi = (cuts[r][k - 1] if k else 0), cuts[r][k]
            def part(name, r=r, k=k):  # the call's own where given (CostModel.call_part)
                return model.call_part.get((r, k, name), model.of(name, r))

            meet = starts[k] + spans[r][k] - part("step_post")
            for a, b, act in tl[lo:hi]:
                comm = act.op.startswith(("SEND", "RECV"))
                peer = 1 - r if comm else -1
                prep = model.stash.get((r, act.chunk, act.op), 0.0)
                if prep:  # the weight-version work before the action (CostModel.stash)
                    mine.append(ev("STASH", s.step_of(act.mb), a - prep, a, mb=act.mb % m,
                                   chunk=act.chunk))
                mine.append(ev(names[act.op], s.step_of(act.mb), a, b,
                               mb=act.mb if comm else act.mb % m, chunk=act.chunk,
                               nbytes=64 if comm else 0, peer=peer))
            end = tl[hi - 1][1] if hi > lo else starts[k] + part("step_pre")
            # the executor finds its sends complete later (a test between actions, the drain)
            mine += [ev("pp.wait", k, end, end, mb=act.mb, chunk=act.chunk, nbytes=64,
                        peer=1 - r) for _, _, act in tl[lo:hi] if act.op.startswith("SEND")]
            if hi > lo:  # the overhead after the last action comes before the reduction
                end += part("overhead")
            mine += [ev("world.allreduce", k, end, meet, nbytes=16),
                     ev("STEP", k, starts[k], starts[k] + spans[r][k])]
        rows.append(mine)
    cfg = gpt_config(schedule=kind, microbatches=m, continuous=True)
    return write(path, rows, {"dp": 1, "pp": pp, "tp": 1}, config=cfg), spans


def test_a_continuous_run_is_predicted_from_its_own_costs(tmp_path):
    """Round trip: a continuous 2BW run made by the step-at-a-time simulation on known costs
    (uneven stages, a p2p latency, each rank's share of the lagged reduction, fixed time
    around it and between calls) is measured and predicted alike: the fit recovers the costs,
    and bubble and step (the longest rank's call) come out as made."""
    from mpipar.analysis import breakdown
    from mpipar.parallel.pipeline.simulate import CostModel

    per_unit = {(0, 0, "F"): 1.0, (0, 0, "BW"): 2.0, (1, 1, "F"): 1.5, (1, 1, "BW"): 2.5,
                (0, 0, "UPDATE"): 0.25, (1, 1, "UPDATE"): 0.25}
    model = CostModel(unit={}, per_unit=per_unit, latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3)
    path, spans = continuous_dump(tmp_path / "cont.h5", model)
    s = breakdown(path)["summary"]
    fitted = s["predicted"]["model"]
    assert fitted["latency"] == pytest.approx(0.2) and fitted["sync"] == pytest.approx(0.5)
    assert fitted["step_gap"] == pytest.approx(0.3)
    assert fitted["overhead"] == pytest.approx(0.0, abs=1e-9)
    assert fitted["jitter_cv"] == pytest.approx(0.0, abs=1e-12)
    assert s["step_time"] == pytest.approx(sum(max(sp[k] for sp in spans) for k in (1, 2, 3)) / 3)
    assert s["step_time_pred"] == pytest.approx(s["step_time"])
    assert 0.05 < s["bubble_pipeline"] < 0.9
    assert s["bubble_pred"] == pytest.approx(s["bubble_pipeline"]), s["predict_note"]
    # its predicted timeline (chrome trace, run_model) is the whole list, a step at a time
    from mpipar.analysis.chrome_trace import predicted_for

    sim = predicted_for(load(path), [1, 2, 3])
    made = build_schedule("pipedream-2bw", 2, 2, steps=4)
    assert [len(tl) for tl in sim.timeline] == [len(a) for a in made.ranks]


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
def test_a_continuous_runs_own_paces_and_stashes_are_fitted(tmp_path, kind):
    """The same round trip with each rank's own fixed costs (``CostModel.per_rank``: the
    first stage's longer gap between calls and per-action overhead), one long gap between two
    calls (``call_gap``: a dump flush) and the weight-version work before its forwards and
    backwards (``CostModel.stash``): each is recovered where it was, and bubble and step come
    out as made; the costs of every rank taken as one (the median) would miss them."""
    from mpipar.analysis import breakdown
    from mpipar.parallel.pipeline.simulate import CostModel

    per_unit = {(0, 0, "F"): 1.0, (0, 0, "BW"): 2.0, (1, 1, "F"): 1.5, (1, 1, "BW"): 2.5,
                (0, 0, "UPDATE"): 0.25, (1, 1, "UPDATE"): 0.25}
    stash = {(0, 0, "F"): 0.3, (0, 0, "BW"): 0.2, (1, 1, "BW"): 0.05}
    per_rank = {(0, "step_gap"): 0.9, (1, "step_gap"): 0.1, (0, "overhead"): 0.04,
                (1, "overhead"): 0.0, (0, "step_post"): 0.2, (1, "step_post"): 0.05}
    model = CostModel(unit={}, per_unit=per_unit, latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3, stash=stash, per_rank=per_rank,
                      call_gap={(0, 2): 4.0})  # a dump flush on rank 0 between calls 2 and 3
    path, spans = continuous_dump(tmp_path / "cont.h5", model, kind=kind, m=4, steps=5)
    s = breakdown(path)["summary"]
    fitted = s["predicted"]["model"]
    assert fitted["stash"] == pytest.approx({f"{p}/{c}/{op}": v for (p, c, op), v in
                                             stash.items()})
    for (p, name), v in per_rank.items():
        assert fitted["per_rank"][f"{p}/{name}"] == pytest.approx(v, abs=1e-9), (p, name)
    assert fitted["call_gap_excess"] == pytest.approx({"0": 4.0 - 0.9, "1": 0.0})
    assert s["step_time_pred"] == pytest.approx(s["step_time"])
    assert s["bubble_pred"] == pytest.approx(s["bubble_pipeline"]), s["predict_note"]
    # without the terms the same run is predicted otherwise
    from mpipar.parallel.pipeline.simulate import simulate_steps  # noqa: F401
    plain = CostModel(unit={}, per_unit=per_unit, latency=0.2, sync=0.5, step_pre=0.1,
                      step_post=0.05, step_gap=0.3)
    path2, _ = continuous_dump(tmp_path / "plain.h5", plain, kind=kind, m=4, steps=5)
    assert breakdown(path2)["summary"]["bubble_pipeline"] != pytest.approx(s["bubble_pipeline"])


def test_each_ranks_predicted_parts_add_up_to_the_predicted_step(tmp_path):
    """Every instant of a rank's simulated step is compute, communication (p2p, waits in the
    closing collective), per-action overhead or its optimizer. Rank 1 of 1F1B finishes first
    and waits for rank 0 in the world all-reduce: that wait was once counted twice (the last
    stage's "communication outside units" came out 22.1 ms against 13.9 measured)."""
    from mpipar.analysis import breakdown
    from mpipar.analysis.synthetic import gpt_config

    r0, r1 = one_f_one_b_step()
    r1 = [(k, s, mb, c, start - OFFSET, end - OFFSET, nb, peer)  # one clock for both
          for (k, s, mb, c, start, end, nb, peer) in r1]
    r0.insert(-1, ev("world.allreduce", 0, 9.76, 9.8, nbytes=8))
    r1.insert(-1, ev("world.allreduce", 0, 7.51, 9.8, nbytes=8))
    path = write(tmp_path / "1f1b.h5", [r0, r1], {"dp": 1, "pp": 2, "tp": 1},
                 config=gpt_config(microbatches=2, schedule="1f1b"))
    s = breakdown(path)["summary"]
    pr, m = s["predicted"], s["predicted"]["model"]
    for r in range(2):
        parts = (pr["compute"][r] + pr["comm"][r] + pr["overhead"][r] + m["optimizer"][r]
                 + m["step_pre"] + m["step_post"])
        assert parts == pytest.approx(s["step_time_pred"], rel=1e-9), r
