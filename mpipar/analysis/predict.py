"""What the simulator predicts for a run, beside what the run measured.

Two predictions. The **calibrated** one (``predicted``, ``bubble_pred``, ``step_time_pred``):
the simulator on a ``CostModel`` fitted from the run's unit measurements
(``mpipar.analysis.costmodel``: per rank and chunk F/B/W, per-action overhead, p2p latency, dp
reductions, optimizer, fixed per-step costs; never from the step time or the bubble it is
compared with), one simulation per pipeline (dp replica and tp rank) on its own unit costs
(``replica_models``: the measured pipeline window spans all ranks, so a replica that waits for a
slower one to join the reduction is idle inside it, and is predicted so), each measured step on
its own unit costs and the results averaged, as the measurement averages steps (``calibrated``),
every compute drawing its duration from the fitted jitter and the prediction the mean of those
draws (``expected_outcomes``, every replay in one batch: ``batch_sim``; mean costs under-count
the waits a slow unit causes), the ranks in their executor's order (the lowered schedule,
``lowering.lower``); a continuous run by ``predict_continuous``; and the memory model
(``mpipar.analysis.memory_model``) beside the measured peak (``measured_memory``:
``mem.static`` + ``mem.peak`` - ``mem.base``, when the run recorded them).

The **uniform predicted bubble** (``bubble_sim``): the simulator with one cost per action kind
for every rank, the measured mean per-chunk F, B, W times ``virtual_stages`` (the simulator takes
per-stage costs; ``BW = B + W``; R is added to B; with no W events B is the whole backward), and
as ``comm`` the median ``pp.send``/``pp.recv`` duration. ``bubble_textbook`` is the closed
formula (e.g. (p-1)/(m+p-1) for GPipe).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..parallel.pipeline.lowering import lower
from .dump import Run
from .flops import setting as get
from .index import events_in, ranks_with_events


def rank_costs(ev: np.ndarray) -> dict:
    """{"F", "B", "W", "R", "p2p": durations} of one rank's events (``measured_costs``)."""
    from . import kinds

    dur, code = ev["end"] - ev["start"], kinds.codes_of(ev)
    out = {k: dur[code == kinds.code(k)] for k in ("F", "B", "W", "R")}
    out["p2p"] = dur[(code == kinds.code("pp.send")) | (code == kinds.code("pp.recv"))]
    return out


def rank_cost_piece(run: Run, r: int, steps) -> dict:
    """``rank_costs`` of rank r's events in ``steps`` (once per run and steps)."""
    from .fit_parts import cached

    return cached(run, r, ("costs", tuple(int(s) for s in steps)),
                  lambda ev: rank_costs(events_in(run, r, steps)))


def measured_costs(run: Run, steps) -> dict:
    """Mean per-chunk F, B, W (and BW) durations and the median p2p transfer time, in seconds.
    Only those durations are gathered, rank after rank (not every event of the run)."""
    cols = {k: [] for k in ("F", "B", "W", "R", "p2p")}
    for rank in ranks_with_events(run):
        got = rank_cost_piece(run, rank, steps)
        for k in cols:
            cols[k].append(got[k])
    got = {k: np.concatenate(v) if v else np.empty(0) for k, v in cols.items()}

    def mean(k):
        return float(got[k].mean()) if got[k].size else 0.0

    f, b, w, r = mean("F"), mean("B"), mean("W"), mean("R")
    p2p = got["p2p"]
    comm = float(np.median(p2p)) if p2p.size else 0.0
    return {"F": f, "B": b + r, "W": w, "BW": b + r + w, "comm": comm}


def predict(run: Run, steps) -> dict:
    """Simulator and textbook bubble for the run's schedule; "n/a" + reason if unavailable."""
    cfg = run.config
    kind = get(cfg, "schedule")
    pp = int(run.grid["pp"])
    m = get(cfg, "microbatches")
    v = int(get(cfg, "virtual_stages", 1) or 1)
    continuous = bool(get(cfg, "continuous", False))
    costs = measured_costs(run, steps)
    out = {
        "costs": costs,
        "bubble_sim": "n/a",
        "bubble_textbook": "n/a",
        "sim_makespan": "n/a",
        "sim_peak_activations": "n/a",
        "predict_note": "",
    }
    if kind is None or m is None:
        out["predict_note"] = "config has no schedule/microbatches"
        return out
    try:
        from mpipar.parallel.pipeline.simulate import simulate, textbook_bubble
    except Exception as exc:  # the schedule module may not be there (yet)
        out["predict_note"] = f"schedule simulator unavailable ({exc.__class__.__name__}: {exc})"
        return out
    try:
        tb = textbook_bubble(kind, pp, int(m), v)
        out["bubble_textbook"] = float(tb) if tb is not None else "n/a"
    except Exception as exc:
        out["predict_note"] += f"textbook_bubble failed ({exc}); "
    try:
        from mpipar.parallel.pipeline.generators import build_schedule

        # the simulator's compute costs are per stage (it divides by virtual for a chunk)
        stage_costs = {k: (c * v if k != "comm" else c) for k, c in costs.items()}
        # a continuous schedule (no flush) is simulated over the measured steps as one run, as
        # its measured bubble_pipeline takes one window over them
        runs = {"steps": len(steps)} if continuous and len(steps) > 1 else {}
        sim = simulate(build_schedule(kind, pp, int(m), virtual_stages=v, **runs),
                       costs=stage_costs)
        out["bubble_sim"] = float(sim.bubble_fraction)
        out["sim_makespan"] = float(sim.makespan)
        out["sim_peak_activations"] = sim.peak_activations
    except Exception as exc:
        out["predict_note"] += f"simulate failed ({exc.__class__.__name__}: {exc})"
        return out
    if continuous:
        out["predict_note"] += ("continuous schedule: bubble_sim is its lists over the measured "
                                "steps with mean costs; the calibrated prediction runs them a "
                                "step at a time, each rank on its own clock; ")
        if len(replica_keys(run)) > 1:  # replicas meet in every UPDATE's reduction: not modelled
            out["predict_note"] += "no calibrated model of a continuous run with dp or tp > 1"
            return out
        try:
            from .predict_continuous import calibrated_continuous

            out.update(calibrated_continuous(run, steps, kind, pp, int(m)))
        except Exception as exc:
            out["predict_note"] += (f"calibrated prediction failed ({exc.__class__.__name__}: "
                                    f"{exc})")
        return out
    try:
        out.update(calibrated(run, steps, kind, pp, int(m), v))
    except Exception as exc:  # a dump the fit cannot use still gets its measured breakdown
        out["predict_note"] += f"calibrated prediction failed ({exc.__class__.__name__}: {exc})"
    return out


def run_model(run: Run, steps, kind: str, pp: int, m: int, v: int):
    """(schedule, fitted CostModel, fit notes, SimResult) of the run's configuration."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.simulate import simulate

    from .costmodel import fit

    if get(run.config, "continuous", False):  # its lists, run a step at a time
        from .predict_continuous import continuous_model

        return continuous_model(run, steps, kind, pp, m)
    sched = lower(build_schedule(kind, pp, m, virtual_stages=v))
    model, notes = fit(run, steps, sched)
    return sched, model, notes, simulate(sched, model)


def replica_keys(run: Run) -> list[tuple[int, int]]:
    """(dp, tp) of each pipeline, in the order of ``replicas``."""
    return sorted({(int(d), int(t)) for d, _, t in run.coords})


def replicas(run: Run) -> list[Run]:
    """One ``Run`` per pipeline: per data-parallel replica and tensor-parallel rank (p2p goes
    between ranks of the same dp and tp coordinates), the same world ranks, the other
    pipelines' events left out. Pipelines meet in the dp reduction and, inside the units, in the
    tp collectives (their waits are part of the unit costs each pipeline measured)."""
    key = [(int(d), int(t)) for d, _, t in run.coords]
    groups = replica_keys(run)
    if len(groups) == 1:
        return [run]
    return [replace(run, events=[ev if key[r] == g else ev[:0] for r, ev in enumerate(run.events)])
            for g in groups]


def replica_models(run: Run, steps, kind: str, pp: int, m: int, v: int, fixed=None,
                   simulate_them: bool = True, sched=None):
    """(schedule, [fitted CostModel], fit notes, [SimResult]): one simulation per pipeline
    (``replicas``), each on its own measured unit costs, so that one replica's slower compute
    shows as the others' wait for the reduction, inside the pipeline window as measured. Each
    replica's dp time, as fitted, includes that wait; the reduction itself is what the replica
    that arrived last spent (the least, per rank and chunk), and every replica gets that.
    ``fixed``: per replica, {attribute: value} to use instead of what ``steps`` give (the p2p
    latency and the compute jitter, fitted over all steps; the fit then skips them). The
    simulations are jitter-free; ``simulate_them`` False: none (an empty list). ``sched``: the
    run's lowered schedule, when the caller has it."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.simulate import simulate

    from .costmodel import fit, jitter

    sched = sched or lower(build_schedule(kind, pp, m, virtual_stages=v))
    given = set(fixed[0]) if fixed else set()
    subs = replicas(run)
    # several replicas draw from one pool, fitted over all of them below
    fitted = [fit(sub, steps, sched, skip=given | ({"jitter"} if len(subs) > 1 else set()))
              for sub in subs]
    models = [mod for mod, _ in fitted]
    keys = set().union(*(mod.dp_reduce for mod in models))
    least = {k: min(mod.dp_reduce.get(k, 0.0) for mod in models) for k in keys}
    if "jitter" in given:
        spread = None
    else:
        spread = jitter(run, steps, sched) if len(models) > 1 else models[0].jitter
    for i, mod in enumerate(models):
        mod.dp_reduce = dict(least)
        if spread is not None:
            mod.jitter = spread  # the machine's, over every rank: one pool replicas draw from
        for name, val in (fixed[i] if fixed is not None else {}).items():
            setattr(mod, name, val)
    sims = [simulate(sched, mod) for mod in models] if simulate_them else []
    return sched, models, fitted[0][1], sims


def mean_outcome(outs: list[dict]) -> dict:
    """The mean of outcome dicts, key by key (lists element-wise)."""
    first = outs[0]
    return {k: (np.mean([o[k] for o in outs], axis=0).tolist() if isinstance(first[k], list)
                else float(np.mean([o[k] for o in outs]))) for k in first}


def expected_outcomes(sched, groups: list, dp: list) -> list[dict]:
    """Per list of replica models in ``groups`` (one per step, say): {step, bubble,
    bubble_step, compute, comm, overhead} of the replicas, averaged over ``samples`` draws of
    the models' compute jitter (one jitter-free replay when no model has jitter). Each draw
    gives every compute its own duration, so a slow one delays the receives that wait for it,
    as in a measured step; the average is the expected step, not the step of expected costs.
    ``dp[i]``: replica i's data-parallel coordinate; draw k of a replica is seeded (k, dp):
    tensor-parallel ranks of one replica draw alike (the collectives inside each unit hold them
    together), dp replicas each their own (deterministic either way). Every replay of every
    group runs in one batch (``batch_sim``)."""
    from .batch_sim import Compiled, evaluate

    models, draws, draws_of = [], [], []
    for mods in groups:
        jit = any(mod.jitter for mod in mods)
        n = max(mod.samples for mod in mods) if jit else 1
        for k in range(n):
            models += mods
            draws += [(k, d) if jit else None for d in dp]
        draws_of.append(n)
    batch = evaluate(Compiled.of(sched), models, draws)
    out, at = [], 0
    for mods, n in zip(groups, draws_of, strict=True):
        size = n * len(mods)
        out.append(_outcome(mods, batch, slice(at, at + size), n))
        at += size
    return out


def _outcome(models, batch, rows: slice, n: int) -> dict:
    """The outcome of ``n`` draws (rows of ``batch``: draw-major, replica-minor) of replicas
    that meet at the gradient-norm collective, averaged over the draws. Step: the last
    replica's pipeline and reduction end, the collective, the slowest optimizer, the fixed
    rest. Per pipeline rank: the mean over replicas. Bubble: 1 - compute / window per rank,
    the window from the first to the last compute over every replica (the measured
    ``bubble_pipeline``'s definition)."""
    reps = len(models)
    shape = (n, reps, -1)
    busy = batch.busy[rows].reshape(shape)
    pend = batch.pipeline_end[rows].reshape(shape)
    pp = busy.shape[2]
    meet = pend.max(axis=(1, 2)) + min(mod.sync for mod in models)
    opt = max(max(mod.optimizer.values(), default=0.0) for mod in models)
    step = meet + opt + min(mod.step_post for mod in models)
    # from each pipeline's own p2p and dp time: the pipe_comm already holds the waits of a
    # meeting of this replica alone, and adding the replicas' meeting to it counted a rank's
    # wait for the last stage twice (a 1F1B pp = 2 last stage: 22.1 predicted, 13.9 measured)
    opt_r = np.array([[mod.optimizer.get(r, 0.0) for r in range(pp)] for mod in models])
    comm = batch.pipe_comm[rows].reshape(shape) + (meet[:, None, None] - pend) + (opt - opt_r)
    first = batch.first_compute[rows].reshape(n, reps).min(axis=1)
    last = batch.last_compute[rows].reshape(n, reps).max(axis=1)
    window = last - first
    flat = busy.reshape(n, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        bubble = np.where(window > 0, (1 - flat / window[:, None]).mean(axis=1), 0.0)
        bubble = np.where(np.isfinite(first), bubble, np.nan)  # no compute: no window
        bubble_step = np.where(step > 0, (1 - flat / step[:, None]).mean(axis=1), 0.0)
    return {"step": float(step.mean()), "bubble": float(bubble.mean()),
            "bubble_step": float(bubble_step.mean()),
            "compute": busy.mean(axis=1).mean(axis=0).tolist(),
            "comm": comm.mean(axis=1).mean(axis=0).tolist(),
            "overhead": batch.overhead[rows].reshape(shape).mean(axis=1).mean(axis=0).tolist()}


def _predict(run: Run, steps, kind: str, pp: int, m: int, v: int) -> tuple:
    """(``expected_outcomes`` of the replicas on costs fitted from ``steps``, schedule, models,
    notes, jitter-free sims)."""
    sched, models, notes, sims = replica_models(run, steps, kind, pp, m, v)
    dp = [d for d, _ in replica_keys(run)]
    return expected_outcomes(sched, [models], dp)[0], sched, models, notes, sims


# the per-step prediction fits each (step, pipeline) on its own: a 1,024-rank run of 1,000 steps
# would fit 256,000 times; beyond this many, an even sample of the steps (and a note saying so)
MAX_STEP_FITS = 4096


def per_step_sample(steps: list, pipelines: int) -> list:
    """The steps the per-step prediction fits: all, or an even sample within ``MAX_STEP_FITS``."""
    from .steps import even_sample

    return even_sample(list(steps), max(2, MAX_STEP_FITS // max(pipelines, 1)))


def calibrated(run: Run, steps, kind: str, pp: int, m: int, v: int) -> dict:
    """The simulator on the fitted cost model, and the memory model; keys in the module doc.

    The measured bubble and step time are means over steps of each step's own (its window, its
    ranks' waits), so the prediction is too: each step's unit costs through the simulator, the
    predictions averaged (the p2p latency, a property of the link, fitted over all steps). The
    mean of per-step bubbles is not the bubble of the mean step: when ranks or replicas take
    turns being the slow one, every step has a straggler that mean costs smooth away. The
    prediction from the costs averaged over all steps is kept beside (``mean_costs``)."""
    from .memory_model import chunk_bounds, rank_memory, with_runtime

    whole, sched, models, notes, sims = _predict(run, steps, kind, pp, m, v)
    pred = whole
    if len(steps) > 1:
        each = per_step_sample(steps, len(models))
        if len(each) < len(steps):
            notes = notes + [f"per-step prediction on {len(each)} of the {len(steps)} measured "
                             f"steps, spread evenly (at most {MAX_STEP_FITS} step x pipeline "
                             "fits); the cost model over all of them"]
        # the mean over the steps averages their draws too: about ``samples`` draws in all
        fixed = [{"latency": mod.latency, "jitter": mod.jitter,
                  "samples": max(8, mod.samples // len(each))} for mod in models]
        groups = [replica_models(run, [s], kind, pp, m, v, fixed, simulate_them=False,
                                 sched=sched)[1] for s in each]
        pred = mean_outcome(expected_outcomes(sched, groups, [d for d, _ in replica_keys(run)]))
    mem = with_runtime(rank_memory(run.config, run.grid, sched, sims[0].peak_activations,
                                   chunk_bounds(run.config, run.grid, v),
                                   events_per_step(run, steps)))
    model = models[0]
    return {
        "step_time_pred": pred["step"],
        "bubble_pred": pred["bubble"],
        "bubble_step_pred": pred["bubble_step"],
        "predicted": {
            "compute": pred["compute"], "comm": pred["comm"], "overhead": pred["overhead"],
            "memory": [r["total"] for r in mem] if mem else None, "memory_parts": mem,
            "model": {k: getattr(model, k) for k in (
                "overhead", "send_post", "recv_post", "latency", "sync", "step_pre",
                "step_post", "default_bytes")} | {
                "optimizer": model.optimizer, "samples": model.samples if model.jitter else 1,
                "jitter_cv": float(np.std(model.jitter)) if model.jitter else 0.0},
            "mean_costs": {"step_time": whole["step"], "bubble": whole["bubble"]},
            "replicas": len(sims),
            "notes": notes,
        },
        "memory_measured": measured_memory(run),
    }


def rank_events_per_step(ev: np.ndarray, steps) -> float:
    """The median over ``steps`` of the events one rank recorded in each."""
    got = np.bincount(ev["step"][np.isin(ev["step"], steps)] - min(steps),
                      minlength=max(steps) - min(steps) + 1)[np.asarray(steps) - min(steps)]
    return float(np.median(got)) if got.size else 0.0


def events_per_step_of(run: Run, r: int, steps) -> float:
    """``rank_events_per_step`` of rank r (once per run and steps)."""
    from .fit_parts import cached

    return cached(run, r, ("per_step", tuple(int(s) for s in steps)),
                  lambda ev: rank_events_per_step(ev, steps))


def events_per_step(run: Run, steps) -> list[float]:
    """Per pipeline coordinate: the events a rank records in a measured step (median over
    the steps and the ranks of that coordinate): what its tracer holds between flushes."""
    per = {}
    for r in range(len(run.events)):
        got = events_per_step_of(run, r, steps)
        per.setdefault(int(run.coords[r, 1]), []).append(got)
    return [float(np.median(per.get(p, [0.0]))) for p in range(int(run.grid["pp"]))]


def measured_memory(run: Run) -> list[float] | None:
    """Per world rank: measured peak bytes, None if unrecorded (``mpipar.training.memory``).

    ``mem.static`` + the largest ``mem.peak`` - ``mem.base``: the state counted exactly plus what
    the steps added above the set-up. Dumps from before ``mem.static`` existed: peak - base."""
    out = []
    for ev in run.events:
        kinds = ev["kind"]
        peak, base = ev[kinds == "mem.peak"], ev[kinds == "mem.base"]
        static = ev[kinds == "mem.static"]
        if not peak.size:
            return None
        got = float(peak["bytes"].max() - (base["bytes"].min() if base.size else 0))
        out.append(got + (float(static["bytes"].max()) if static.size else 0.0))
    return out
