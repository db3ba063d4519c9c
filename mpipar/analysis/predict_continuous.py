"""The calibrated prediction of a continuous run (PipeDream / 2BW without a flush).

A continuous run's lists span its steps (``Schedule.steps``), but the trainer calls the
executor a step at a time (``actions.step_cuts``: step k's call runs a rank's actions up to
the last one of a step-k micro-batch). The ranks never meet between calls: each posts its share
of the loss (and stop) reduction and reads one ``LAG`` steps old (``training/lagged.py``), so
each rank runs its calls back to back and waits only in its receives. The prediction replays
the run's lists that way (``simulate.simulate_steps``), on costs fitted from the dump
(``fit_continuous``: per rank and chunk F / B / W and UPDATE, each step at its own means
(``step_unit``: a rank slow for a step stalls its neighbour then), the weight-version work
(STASH) before each F, BW and UPDATE, the overhead per action, the p2p
latency, the rank's own time in the lagged reduction, the fixed time before and after each
call (each call's own where measured: ``call_part``) and between calls, the compute jitter
within a step), and takes what the measurement takes: the step
is the longest rank's call (``breakdown._step_times``: the ranks' calls of one step are not
simultaneous, a stage runs a little ahead), the bubble each rank's share of its calls not
spent in model compute (``breakdown._continuous_bubble``), mean over ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from .costmodel import (
    PIPE_KINDS,
    _med,
    _uncovered,
    jitter,
    one_way_minima,
    post_costs,
    unit_costs,
)
from .dump import Run
from .units import UNIT_KINDS


def as_one_step(run: Run, m: int, steps) -> Run:
    """The run's measured steps as one step (numbered ``steps[0]``), every compute event's
    micro-batch numbered as in the run-long lists (step * m + its number in the step;
    communication events carry that number already). A message of one step is often sent or
    waited for in another's call (at m = 1 a rank sends F(k) and receives the gradient of k
    under one key, in two calls): the latency fit matches each receive to its wait and its send
    over the whole window, not step by step."""
    events = []
    for ev in run.events:
        ev = ev.copy()
        unit = np.isin(ev["kind"], UNIT_KINDS) & (ev["mb"] >= 0) & (ev["step"] >= 0)
        ev["mb"][unit] = ev["step"][unit] * m + ev["mb"][unit]
        ev["step"][np.isin(ev["step"], steps)] = steps[0]
        events.append(ev)
    return replace(run, events=events)


def _calls(run: Run, steps):
    """(world rank, step, events of that rank's call of that step): the events inside its STEP
    marker, whatever step their micro-batch belongs to, sorted by start."""
    for r, ev in enumerate(run.events):
        marks = ev[ev["kind"] == "STEP"]
        for s in steps:
            mk = marks[marks["step"] == s]
            if not mk.size:
                continue
            lo, hi = float(mk["start"].min()), float(mk["end"].max())
            inside = ev[(ev["start"] >= lo) & (ev["end"] <= hi) & (ev["kind"] != "STEP")
                        & ~np.char.startswith(ev["kind"].astype(str), "mem.")]
            yield r, s, lo, hi, np.sort(inside, order="start")


def _latencies(run: Run, steps, schedule) -> tuple[list[float], bool]:
    """(p2p latency per pair of neighbouring ranks, whether some pair had to assume no clock
    offset). Both directions' minima averaged cancel the ranks' clock offset
    (``costmodel.transfer_times``); in a continuous run one direction often has no receive that
    waited for its send (at small m a rank sends its forward a step before the peer takes it),
    and the ranks never meet to measure the offset at: there the one direction's minimum, the
    clocks taken as one (each rank starts its clock right after a world barrier)."""
    best = one_way_minima(as_one_step(run, schedule.microbatches, steps), steps[:1], schedule)
    out, assumed = [], False
    for (a, b), d in best.items():
        if (b, a) in best:
            if a < b:
                out.append(max(0.0, (d + best[(b, a)]) / 2))
        else:
            out.append(max(0.0, d))
            assumed = True
    return out, assumed


def in_calls(run: Run, steps) -> tuple[Run, list[int]]:
    """(the run with only the events inside the measured steps' calls tagged with a step, the
    step tags found there). The units a prediction of those calls must cost are the ones they
    ran (``breakdown._continuous_bubble`` counts the same): the first measured micro-batch's
    forward runs in the warm-up call before, often slower, and the calls run some of the step
    before's units."""
    marks = np.concatenate(run.events)
    marks = marks[(marks["kind"] == "STEP") & np.isin(marks["step"], steps)]
    if not marks.size:
        return run, list(steps)
    lo, hi = float(marks["start"].min()), float(marks["end"].max())
    events = []
    for ev in run.events:
        ev = ev.copy()
        ev["step"][(ev["start"] < lo) | (ev["end"] > hi)] = -1
        events.append(ev)
    tags = sorted({int(t) for ev in events for t in np.unique(ev["step"]) if t >= 0})
    return replace(run, events=events), tags


def fit_continuous(run: Run, steps, schedule, cuts):
    """``CostModel`` of a continuous run (module doc); ``cuts[p]``: ``step_cuts`` of rank p's
    actions in the executor's order. Nothing from the step time or the bubble."""
    from mpipar.parallel.pipeline.simulate import CostModel

    inside, tags = in_calls(run, steps)
    model = CostModel(per_unit=unit_costs(inside, tags), unit={}, jitter=jitter(inside, tags))
    model.rank_jitter = rank_jitter(inside, tags)
    upd = defaultdict(list)  # UPDATE: the optimizer step of a chunk, recorded as OPT with a chunk
    upd_step = defaultdict(list)  # and in each step on its own (``step_unit``)
    for r, ev in enumerate(run.events):
        o = ev[(ev["kind"] == "OPT") & (ev["chunk"] >= 0) & np.isin(ev["step"], steps)]
        p = int(run.coords[r, 1])
        for c in np.unique(o["chunk"]):
            d = o[o["chunk"] == c]
            upd[(p, int(c))].append(float((d["end"] - d["start"]).mean()))
            for s, dur in zip(d["step"].tolist(), (d["end"] - d["start"]).tolist(), strict=True):
                upd_step[(p, s, int(c), "UPDATE")].append(dur)
    model.per_unit.update({(p, c, "UPDATE"): float(np.mean(v)) for (p, c), v in upd.items()})
    model.step_unit = typical_elsewhere(
        step_unit_costs(inside, tags) | {k: float(np.mean(v)) for k, v in upd_step.items()},
        schedule.steps)
    model.microbatches = schedule.microbatches
    model.stash = stash_costs(run, steps)
    parts = defaultdict(list)  # (pp rank, name) -> one value per call
    ends = defaultdict(list)
    for r, s, lo, hi, e in _calls(run, steps):
        if not e.size:
            continue
        p = int(run.coords[r, 1])
        n = cuts[p][s] - (cuts[p][s - 1] if s > 0 else 0)  # the lists start at step 0
        coll = e[np.char.startswith(e["kind"].astype(str), "world.")]
        pipe = e[np.isin(e["kind"], PIPE_KINDS + ("OPT", "STASH"))]  # STASH: ``stash_costs``
        got = {"step_pre": float(e["start"].min()) - lo, "step_post": hi - float(e["end"].max()),
               # each rank's own post and read of the lagged reduction: nobody waits there
               "sync": float((coll["end"] - coll["start"]).sum())}
        if pipe.size and n > 1:  # the time between its n actions: n - 1 gaps (the one after
            # the last is the simulation's too, before the lagged reduction: measured nowhere)
            got["overhead"] = _uncovered(pipe["start"], pipe["end"]) / (n - 1)
        for name, val in got.items():
            parts[(p, name)].append(val)
            model.call_part[(p, s, name)] = val  # where it was (``CostModel.call_part``)
        ends[p].append((lo, hi, s))
    # between a rank's calls (the loop's own work: metrics, progress, dump flushes): the
    # neighbour waiting for this rank's next message waits through it; each measured one where
    # it was (a dump flush is one long gap in fifty), their median elsewhere
    for p, calls in ends.items():
        calls = sorted(calls)
        for a, b in zip(calls, calls[1:]):
            parts[(p, "step_gap")].append(b[0] - a[1])
            if b[2] == a[2] + 1:
                model.call_gap[(p, a[2])] = b[0] - a[1]
    # one value per rank (the ranks keep their own pace: ``CostModel.per_rank``), and the
    # median over every call as the value for all
    for name in ("overhead", "step_pre", "step_post", "sync", "step_gap"):
        setattr(model, name, _med([v for (_, k), vs in parts.items() if k == name for v in vs]))
    model.per_rank = {key: _med(vs) for key, vs in parts.items() if vs}
    ev = np.concatenate(run.events)
    ev = ev[np.isin(ev["step"], steps)]
    model.send_post, model.recv_post = post_costs(ev)
    lat, assumed = _latencies(run, steps, schedule)
    model.latency = _med(lat)
    notes = [] if lat else ["no receive waited for its send: p2p latency 0"]
    if assumed:
        notes.append("p2p latency of one direction only, the ranks' clocks taken as one")
    return model, notes


def rank_jitter(run: Run, tags) -> dict:
    """{pp rank: ``costmodel.jitter`` of that rank's units alone}: in a pipeline that never
    drains, a unit of the stage with slack that runs long stalls its neighbour, one of the other
    stage does not; drawn from one pool for both, a noisier first stage would stall the last
    less often in the simulation than it does (only the ranks with repeating units)."""
    out = {}
    for r in range(run.world_size):
        one = replace(run, events=[ev if q == r else ev[:0] for q, ev in enumerate(run.events)])
        j = jitter(one, tags)
        if j:
            out[int(run.coords[r, 1])] = j
    return out


def step_unit_costs(run: Run, tags) -> dict:
    """{(pp rank, step, chunk, op): ``unit_costs`` of that step alone} (``CostModel.step_unit``):
    a rank's pace drifts from step to step (another process on its core, the allocator), and
    in a pipeline that never drains a rank's slow step stalls its neighbour then, where the run's
    mean spreads it over every step; ``jitter`` is the spread within a step only, so each step
    costs its own means, as a flushing run's prediction takes each step's own."""
    out = {}
    for s in tags:
        out.update({(p, s, c, op): v for (p, c, op), v in unit_costs(run, [s]).items()})
    return out


def typical_elsewhere(costs: dict, steps: int) -> dict:
    """``costs`` ({(p, step, chunk, op): seconds}) with every step of ``range(steps)`` that has
    none (the warm-up call's, those after the measured ones) given the median over the steps that
    have: a typical step, which the run's mean, pulled up by one slow step, is not."""
    by_key = defaultdict(list)
    for (p, _, c, op), v in costs.items():
        by_key[(p, c, op)].append(v)
    out = dict(costs)
    for (p, c, op), vals in by_key.items():
        typical = float(np.median(vals))
        for s in range(steps):
            out.setdefault((p, s, c, op), typical)
    return out


def step_spread(model, steps) -> dict:
    """{pp rank: spread (standard deviation) over the measured ``steps`` of the rank's per-step
    unit costs over its run means} (how far ``step_unit`` moves the prediction from them)."""
    ratios = defaultdict(lambda: defaultdict(list))
    for (p, s, c, op), v in model.step_unit.items():
        mean = model.per_unit.get((p, c, op))
        if mean and s in steps:
            ratios[p][s].append(v / mean)
    return {str(p): float(np.std([np.mean(x) for x in by.values()]))
            for p, by in sorted(ratios.items())}


STASH_BEFORE = {"F": "F", "B": "BW", "OPT": "UPDATE"}  # the region after a STASH -> its action


def stash_costs(run: Run, steps) -> dict:
    """{(pp rank, chunk, op): mean STASH time before each such action} over the measured steps:
    a rank's weight-version work is concentrated before its forwards (copies) and backwards
    (swap, zeroing), where it delays the next send; spread over every action as overhead it
    would not (the first stage stashes more than the last). Each action counts, stash or not."""
    time, count = defaultdict(float), defaultdict(int)
    for r, ev in enumerate(run.events):
        p = int(run.coords[r, 1])
        e = np.sort(ev[np.isin(ev["step"], steps) & (ev["chunk"] >= 0)
                       & np.isin(ev["kind"], ("STASH",) + tuple(STASH_BEFORE))], order="start")
        pending = defaultdict(float)  # chunk -> STASH time not yet given to an action
        for x in e:
            kind, c = str(x["kind"]), int(x["chunk"])
            if kind == "STASH":
                pending[c] += float(x["end"] - x["start"])
            else:
                key = (p, c, STASH_BEFORE[kind])
                time[key] += pending.pop(c, 0.0)
                count[key] += 1
    return {k: time[k] / count[k] for k in count if time[k] > 0}


def _outcome(sim, spans, cuts, steps) -> dict:
    """{step, bubble, compute} of the measured steps' calls, as ``breakdown`` measures them:
    the mean over steps of the longest rank's call, and per rank 1 - its model compute in its
    calls / their total span, mean over ranks."""
    k0, k1 = min(steps), max(steps)
    busy, bubble = [], []
    for r, tl in enumerate(sim.timeline):
        calls = tl[(cuts[r][k0 - 1] if k0 > 0 else 0):cuts[r][k1]]
        busy.append(sum(b - a for a, b, act in calls if act.op in ("F", "B", "W", "BW")))
        total = sum(spans[r][k] for k in steps)
        bubble.append(1 - busy[-1] / total if total > 0 else 0.0)
    return {"step": float(np.mean([max(sp[k] for sp in spans) for k in steps])),
            "bubble": float(np.mean(bubble)), "compute": busy}


def _model(run: Run, steps, kind: str, pp: int, m: int) -> tuple:
    """(schedule, fitted CostModel, notes, (jitter-free SimResult, spans), executor order, cuts)
    of the run's lists, one from step 0 to the last (the trainer drains only there when no
    evaluation or checkpoint stops it first)."""
    from mpipar.parallel.pipeline.actions import step_cuts
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import simulate_steps

    if len({(int(d), int(t)) for d, _, t in run.coords}) > 1:
        raise ValueError("a continuous run with dp or tp > 1 has no calibrated model yet")
    sched = lower(build_schedule(kind, pp, m, steps=max(run.steps()) + 1))
    order = sched.ranks  # the executor's order
    cuts = [step_cuts(sched, acts) for acts in order]
    model, notes = fit_continuous(run, steps, sched, cuts)
    return sched, model, notes, simulate_steps(sched, model, order, cuts), order, cuts


def continuous_model(run: Run, steps, kind: str, pp: int, m: int) -> tuple:
    """(schedule, CostModel, notes, SimResult): ``predict.run_model`` for a continuous run."""
    sched, model, notes, (sim, _), _, _ = _model(run, steps, kind, pp, m)
    return sched, model, notes, sim


def calibrated_continuous(run: Run, steps, kind: str, pp: int, m: int) -> dict:
    """``predict.calibrated``'s keys for a continuous run (pp only: one pipeline)."""
    from mpipar.parallel.pipeline.simulate import simulate_steps

    sched, model, notes, plain, order, cuts = _model(run, steps, kind, pp, m)
    total = sched.steps
    whole = _outcome(*plain, cuts, steps)
    draws = [_outcome(*simulate_steps(sched, model, order, cuts, draw=k), cuts, steps)
             for k in range(model.samples)] if model.jitter else [whole]
    pred = {k: float(np.mean([d[k] for d in draws])) for k in ("step", "bubble")}
    compute = np.mean([d["compute"] for d in draws], axis=0) / len(steps)
    return {
        "step_time_pred": pred["step"], "bubble_pred": pred["bubble"],
        "predicted": {
            "compute": compute.tolist(),
            "model": {k: getattr(model, k) for k in (
                "overhead", "send_post", "recv_post", "latency", "sync", "step_pre",
                "step_post", "step_gap", "default_bytes")} | {
                "stash": {f"{p}/{c}/{op}": v for (p, c, op), v in sorted(model.stash.items())},
                "per_rank": {f"{p}/{k}": v for (p, k), v in sorted(model.per_rank.items())},
                # the measured gaps between calls beyond each rank's median (dump flushes)
                "call_gap_excess": {str(p): sum(g - model.of("step_gap", p) for (q, _), g in
                                                model.call_gap.items() if q == p)
                                    for p in sorted({q for q, _ in model.call_gap})},
                "samples": model.samples if model.jitter else 1,
                "jitter_cv": float(np.std(model.jitter)) if model.jitter else 0.0,
                "rank_jitter_cv": {str(p): float(np.std(j))
                                   for p, j in sorted(model.rank_jitter.items())},
                "step_unit_steps": len({s for _, s, _, _ in model.step_unit} & set(steps)),
                "step_unit_cv": step_spread(model, set(steps)),
                "call_parts": len({(p, k) for p, k, _ in model.call_part})},
            "mean_costs": {"step_time": whole["step"], "bubble": whole["bubble"]},
            "replicas": 1, "continuous_steps": total,
            "notes": notes,
        },
    }
