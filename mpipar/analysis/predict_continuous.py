"""The calibrated prediction of a continuous run (PipeDream / 2BW without a flush).

A continuous run's lists span its steps (``Schedule.steps``), but the trainer still calls the
executor a step at a time (``actions.step_cuts``: step k's call runs a rank's actions up to
the last one of a step-k micro-batch), and every call ends in the loss all-reduce of the whole
world: every step, the ranks meet. That meeting is most of a continuous run's bubble (the
simulation of the lists alone, with nothing between the steps, has 2.7 % at m = 8 where
PipeDream measured 24.7 %). So the prediction replays the run's lists with those barriers
(``simulate.simulate_steps``), on costs fitted from the dump (``fit_continuous``: per rank and
chunk F / B / W and UPDATE, the overhead per action, the p2p latency, the all-reduce, the fixed
time before and after each call, the compute jitter), and takes what the measurement takes
(``breakdown._continuous_bubble``): one pipeline window over the model compute of the measured
steps' calls, and the mean step.
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


def _clock_offsets(run: Run, steps) -> list[float]:
    """Per world rank, its clock minus rank 0's: the median over steps of the difference of
    the ends of the step's world collective (every rank leaves it within a message of the
    others)."""
    ends = defaultdict(dict)
    for r, s, _, _, e in _calls(run, steps):
        coll = e[np.char.startswith(e["kind"].astype(str), "world.")]
        if coll.size:
            ends[r][s] = float(coll["end"].max())
    out = []
    for r in range(run.world_size):
        both = [ends[r][s] - ends[0][s] for s in ends[r] if s in ends[0]]
        out.append(_med(both))
    return out


def _latencies(run: Run, steps, schedule) -> list[float]:
    """p2p latency per pair of neighbouring ranks. In a continuous run one direction often has
    no receive that waited for its send (at small m a rank sends its forward a step before the
    peer takes it): the other direction's minimum, less the clock offset measured at the
    steps' collectives, bounds the latency. The smaller of the two directions' bounds."""
    best = one_way_minima(as_one_step(run, schedule.microbatches, steps), steps[:1], schedule)
    off = _clock_offsets(run, steps)
    pairs = defaultdict(list)
    for (a, b), d in best.items():
        pairs[(min(a, b), max(a, b))].append(d - (off[b] - off[a]))
    return [max(0.0, min(v)) for v in pairs.values()]


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
    upd = defaultdict(list)  # UPDATE: the optimizer step of a chunk, recorded as OPT with a chunk
    for r, ev in enumerate(run.events):
        o = ev[(ev["kind"] == "OPT") & (ev["chunk"] >= 0) & np.isin(ev["step"], steps)]
        for c in np.unique(o["chunk"]):
            d = o[o["chunk"] == c]
            upd[(int(run.coords[r, 1]), int(c))].append(float((d["end"] - d["start"]).mean()))
    model.per_unit.update({(p, c, "UPDATE"): float(np.mean(v)) for (p, c), v in upd.items()})
    over, pre, post, meet = [], [], defaultdict(list), defaultdict(list)
    for r, s, lo, hi, e in _calls(run, steps):
        if not e.size:
            continue
        p = int(run.coords[r, 1])
        n = cuts[p][s] - (cuts[p][s - 1] if s > 0 else 0)  # the lists start at step 0
        coll = e[np.char.startswith(e["kind"].astype(str), "world.")]
        pipe = e[np.isin(e["kind"], PIPE_KINDS + ("OPT",))]
        if pipe.size and n > 0:
            over.append(_uncovered(pipe["start"], pipe["end"]) / n)
        pre.append(float(e["start"].min()) - lo)
        post[s].append(hi - float(e["end"].max()))
        meet[s].append(float((coll["end"] - coll["start"]).sum()))
    model.overhead = _med(over)
    model.step_pre = _med(pre)
    # the last rank to arrive waits least: the all-reduce itself, and the rest after it
    model.sync = _med([min(v) for v in meet.values()])
    model.step_post = _med([min(v) for v in post.values()])
    ev = np.concatenate(run.events)
    ev = ev[np.isin(ev["step"], steps)]
    model.send_post, model.recv_post = post_costs(ev)
    lat = _latencies(run, steps, schedule)
    model.latency = _med(lat)
    notes = [] if lat else ["no messages both ways between two ranks to time: p2p latency 0"]
    return model, notes


def _outcome(sim, spans, cuts, steps) -> dict:
    """{step, bubble, compute}: the measured steps' mean span and one pipeline window over the
    model compute of their calls (``breakdown._continuous_bubble`` measures the same)."""
    k0, k1 = min(steps), max(steps)
    busy, lo, hi = [], np.inf, -np.inf
    for r, tl in enumerate(sim.timeline):
        calls = tl[(cuts[r][k0 - 1] if k0 > 0 else 0):cuts[r][k1]]
        mine = [(a, b) for a, b, act in calls if act.op in ("F", "B", "W", "BW")]
        busy.append(sum(b - a for a, b in mine))
        if mine:
            lo, hi = min(lo, mine[0][0]), max(hi, max(b for _, b in mine))
    window = hi - lo
    return {"step": float(np.mean([spans[s] for s in steps])),
            "bubble": float(np.mean([1 - b / window for b in busy])) if window > 0 else 0.0,
            "compute": busy}


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
                "step_post", "default_bytes")} | {
                "samples": model.samples if model.jitter else 1,
                "jitter_cv": float(np.std(model.jitter)) if model.jitter else 0.0},
            "mean_costs": {"step_time": whole["step"], "bubble": whole["bubble"]},
            "replicas": 1, "continuous_steps": total,
            "notes": notes,
        },
    }
