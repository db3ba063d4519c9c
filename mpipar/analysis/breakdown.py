"""Where each rank's step time went: compute by action, communication by axis, idle, bubble.

All numbers are seconds *per step*, averaged over the measured steps. Definitions:

- **step window** of a rank: its ``STEP`` event (the writer's marker); if a step has none, the
  span of that rank's events in the step (noted in ``notes``).
- **compute** ``F, B, W, R, LOSS, OPT``: summed event durations per kind.
- **communication** by axis: ``comm_pp`` (``pp.*``, pipeline p2p), ``comm_tp`` (``tp.*``),
  ``comm_dp`` (``dp.*``, gradient sync), ``comm_world`` (``world.*``); summed durations. A
  non-blocking send posted during compute overlaps it, so these sums can add up to more than
  the step.
- **self time** (``self_F`` ... ``self_OPT``, ``self_pp`` ... ``self_world``, ``self_other``):
  each instant of the step counted once, like a profiler's self time. A rank runs one Python
  thread, so overlapping events are nested calls (a ``tp.allreduce`` inside ``F``, the
  ``world.*`` norm inside ``OPT``) or posted operations; communication takes precedence over
  compute, compute over other kinds, in the order of ``SELF_ORDER``. So the self times plus
  ``idle`` add up to the step time exactly; the plots stack these.
- **busy** = length of the *union* of all event intervals (clipped to the step window);
  **idle** = step time - busy. **exposed** = busy - union(compute): communication (and any other
  non-compute event) not hidden under compute. So ``union(compute) + exposed + idle = step``.
- **bubble** (measured, per rank) = ``1 - (F+B+W+R+LOSS) / step time``: the share of the rank's
  step not spent in model compute (waiting on pipeline neighbours, communication, optimizer).
  Inclusive durations: a tensor-parallel collective nested inside ``F`` counts as compute here
  (it is part of computing the layer); pipeline waits sit outside F/B and count as bubble.
  The run's ``bubble`` is the mean over measured steps and ranks. ``bubble_pipeline`` uses the
  pipeline window instead of the whole step (first compute start to last compute end over all
  ranks, excluding ``OPT``), which is what a schedule simulator models; for a continuous
  schedule (no flush between steps) each rank's measured calls (``_continuous_bubble``).
- **predicted bubble**: see ``mpipar.analysis.predict`` (the simulator on the measured costs).
- **throughput**: run step time = per step, last ``STEP`` end - first ``STEP`` start over all
  ranks (a continuous run: the longest rank's own ``STEP``), averaged; tokens/s = tokens per
  step / step time; FLOPs per step from ``mpipar.analysis.flops`` (formula there); MFU =
  FLOP/s / (peak per device x devices), where
  devices are the distinct (hostname, device) pairs of the run (8 CPU ranks on one host share
  one "cpu" device, 8 GPU ranks use 8). The peak comes from ``--peak`` (per device) or the
  dump's ``peak_flops`` attribute (a measured GEMM peak); which one is in ``peak_source``.
"""

from __future__ import annotations

import math

import numpy as np

from . import flops as _flops
from .bandwidth import bandwidth
from .dump import Run, load
from .flops import setting as get
from .links import links_text
from .predict import predict
from .rank_steps import (
    COMM_AXES,
    COMPUTE_KINDS,
    PIPE_COMPUTE,
    SELF_ORDER,
    rank_steps,
    union_length,  # noqa: F401 (re-exported)
)
from .steps import StepChoice

SELF_COLUMNS = tuple(f"self_{k}" for k in SELF_ORDER)

RANK_COLUMNS = (
    ("rank", "dp", "pp", "tp", "step_time")
    + COMPUTE_KINDS
    + ("compute",)
    + tuple(f"comm_{a}" for a in COMM_AXES)
    + ("comm", "other", "busy", "exposed", "idle", "bubble")
    + SELF_COLUMNS
)


def select_steps(run: Run, step: int | None = None) -> tuple[list[int], list[str]]:
    """The steps to measure and notes on the choice (warm-up step 0 skipped when there are more;
    ``mpipar.analysis.steps``). A run loaded with a step choice (``load(steps=...)``) holds only
    those steps: its choice, unless ``step`` asks for one of them."""
    measured = run.cache.get("measured")  # a streamed run: the steps its pass summarised
    if measured is not None:
        if measured[2] != step:
            from .dump import DumpError

            raise DumpError(f"{run.path}: streamed for step {measured[2]}, asked for step "
                            f"{step}; load it with analysis.stream.load(path, step={step})")
        return list(measured[0]), list(measured[1])
    if step is None and run.selection is not None:
        steps, notes = run.selection
        return list(steps), list(notes)
    return StepChoice(step=step).choose(run.steps(), run.path)



# what the run-level numbers read of a rank's steps (``_matrix``); the other columns are only
# ever averaged over the steps, so a rank keeps their means
STEP_COLUMNS = ("has", "marked", "lo", "hi", "pipe_lo", "pipe_hi", "pipe_compute")


def rank_summary(ev: np.ndarray, steps) -> dict:
    """``rank_steps``' per-step arrays the run-level numbers need, and each value column's
    mean over the steps the rank has events in ("means")."""
    d = rank_steps(ev, steps)
    out = {c: d[c] for c in STEP_COLUMNS}
    out["means"] = {c: float(np.mean(d[c][d["has"]])) if d["has"].any() else math.nan
                    for c in RANK_COLUMNS if c not in ("rank", "dp", "pp", "tp")}
    return out


def rank_row(run: Run, r: int, steps) -> dict:
    """``rank_summary`` of world rank r (once per run and steps: ``fit_parts.cached``)."""
    from .fit_parts import cached

    key = tuple(int(s) for s in steps)
    return cached(run, r, ("breakdown", key), lambda ev: rank_summary(ev, steps))


def breakdown(run: Run | str, step: int | None = None, peak: float | None = None) -> dict:
    """Per-rank table and run summary of the measured steps (definitions in the module doc).

    Returns ``{"run", "path", "steps", "notes", "ranks": {column: np.ndarray over world ranks},
    "summary": {...}}``. ``peak``: FLOP/s per device (overrides the dump's ``peak_flops``).
    """
    if not isinstance(run, Run):
        run = load(run)
    steps, notes = select_steps(run, step)
    notes += run.notes
    world = run.world_size
    per = [rank_row(run, r, steps) for r in range(world)]
    for r, d in enumerate(per):
        for i in np.flatnonzero(d["has"] & ~d["marked"]):
            notes.append(f"rank {r} step {steps[i]}: no STEP event, step window = span of its "
                         "events")

    table = {
        "rank": np.arange(world),
        "dp": run.coords[:, 0].copy(),
        "pp": run.coords[:, 1].copy(),
        "tp": run.coords[:, 2].copy(),
    }
    value_cols = [c for c in RANK_COLUMNS if c not in table]
    for c in value_cols:
        table[c] = np.array([d["means"][c] for d in per])
    missing = [r for r in range(world) if not per[r]["has"].any()]
    if missing:
        notes.append(f"ranks {missing} have no events in the measured steps")

    summary = _summary(run, steps, per, table, notes, peak)
    return {
        "run": run.name,
        "path": run.path,
        "steps": steps,
        "notes": notes,
        "ranks": table,
        "summary": summary,
        "bandwidth": bandwidth(run, steps),  # from the loaded run: no second read of the file
        "links": links_text(run, steps),  # several hosts: bytes per link class, else ""
    }


def _matrix(per, col) -> np.ndarray:
    """(ranks, steps) of a column, NaN where a rank has no events in a step."""
    return np.array([np.where(d["has"], d[col], math.nan) for d in per]).reshape(len(per), -1)


def _step_times(steps, per, continuous=False) -> np.ndarray:
    """Per step, first STEP start to last STEP end over all ranks; a continuous run's ranks
    never meet between steps (one stage runs its call of a step a little ahead of the other's),
    so there the longest rank's own call."""
    has = np.array([d["has"] for d in per]).reshape(len(per), -1).any(axis=0)
    with np.errstate(invalid="ignore"):
        if continuous:
            own = _matrix(per, "hi") - _matrix(per, "lo")
            return np.nanmax(np.where(np.isnan(own), -math.inf, own), axis=0)[has]
        hi = np.nanmax(np.where(has, _matrix(per, "hi"), -math.inf), axis=0)
        lo = np.nanmin(np.where(has, _matrix(per, "lo"), math.inf), axis=0)
    return (hi - lo)[has]


def _continuous_bubble(run, per) -> float:
    """The pipeline bubble of a continuous run (PipeDream without a flush): consecutive steps'
    micro-batches overlap and the ranks never meet, so neither a per-step window nor one window
    over all ranks fits. Per rank, 1 - its model compute inside its measured steps' calls / the
    calls' total span (between calls: dump flushes, progress lines, not the pipeline's), mean
    over ranks (``predict_continuous`` simulates the same)."""
    vals = []
    for r, ev in enumerate(run.events):
        d = per[r]
        calls = list(zip(d["lo"][d["has"]].tolist(), d["hi"][d["has"]].tolist(), strict=True))
        e = ev[np.isin(ev["kind"], PIPE_COMPUTE)]
        total = sum(hi - lo for lo, hi in calls)
        if total <= 0:
            continue
        busy = sum(float((x["end"] - x["start"]).sum()) for lo, hi in calls
                   for x in [e[(e["start"] >= lo) & (e["end"] <= hi)]])
        vals.append(1.0 - busy / total)
    return float(np.mean(vals)) if vals else math.nan


def _pipeline_bubble(steps, per) -> float:
    """1 - model compute / pipeline window, window shared by all ranks in a step; mean over both
    (a continuous run: ``_continuous_bubble``)."""
    has = np.array([d["has"] for d in per]).reshape(len(per), -1)
    plo, phi = _matrix(per, "pipe_lo"), _matrix(per, "pipe_hi")
    timed = ~np.isnan(plo).all(axis=0)
    with np.errstate(invalid="ignore"):
        lo = np.nanmin(np.where(timed, plo, 0.0), axis=0)
        hi = np.nanmax(np.where(timed, phi, 0.0), axis=0)
        ok = timed & (hi > lo)
        vals = 1.0 - _matrix(per, "pipe_compute") / (hi - lo)
    # step after step, the ranks with events in each (as the measured values were listed)
    got = vals.T[(has & ok).T]
    return float(np.mean(got)) if got.size else math.nan


def _devices(run: Run) -> int:
    """Distinct (hostname, device) pairs: the number of peak-FLOP units the run used."""
    hosts = run.attrs.get("hostnames")
    devs = run.attrs.get("devices")
    pairs = set()
    for r in range(run.world_size):
        a = run.rank_attrs[r] if r < len(run.rank_attrs) else {}
        host = a.get("hostname", hosts[r] if isinstance(hosts, list) and r < len(hosts) else None)
        dev = a.get("device", devs[r] if isinstance(devs, list) and r < len(devs) else None)
        if host is None or dev is None:
            return run.world_size  # unknown layout: one device per rank
        pairs.add((str(host), str(dev)))
    return len(pairs)


def _summary(run, steps, per, table, notes, peak) -> dict:
    cfg = run.config
    step_times = _step_times(steps, per, bool(get(cfg, "continuous", False)))
    step_time = float(step_times.mean()) if step_times.size else math.nan
    tokens = _flops.tokens_per_step(cfg)
    fl = _flops.flops_per_step(cfg)
    s = {
        "run": run.name,
        "world_size": run.world_size,
        "dp": int(run.grid["dp"]),
        "pp": int(run.grid["pp"]),
        "tp": int(run.grid["tp"]),
        "schedule": get(cfg, "schedule", "n/a"),
        "microbatches": get(cfg, "microbatches"),
        "virtual_stages": get(cfg, "virtual_stages", 1),
        "model": _flops.model_kind(cfg),
        "device": get(cfg, "device", "n/a"),
        "dtype": get(cfg, "dtype", "n/a"),
        "complete": run.complete,
        "steps_measured": len(steps),
        "step_time": step_time,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_time if tokens and step_time > 0 else math.nan,
        "n_params": _flops.n_params(cfg),
        "flops_per_step": fl,
        "flops_per_s": fl / step_time if fl and step_time > 0 else math.nan,
    }
    # peak and MFU
    devices = _devices(run)
    if peak is not None:
        s["peak"], s["peak_source"] = float(peak), "--peak"
    elif run.peak_flops is not None:
        s["peak"], s["peak_source"] = run.peak_flops, "dump attr peak_flops"
    else:
        s["peak"], s["peak_source"] = math.nan, "none (pass --peak FLOPS per device)"
    s["devices"] = devices
    total_peak = s["peak"] * devices
    s["mfu"] = s["flops_per_s"] / total_peak if total_peak > 0 else math.nan
    # time shares, mean over ranks of each rank's per-step share
    st = table["step_time"]
    with np.errstate(invalid="ignore", divide="ignore"):
        for c in ("compute", "comm", "exposed", "idle"):
            s[f"{c}_frac"] = float(np.nanmean(table[c] / st)) if st.size else math.nan
    s["bubble"] = float(np.nanmean(table["bubble"]))
    s["bubble_pipeline"] = (_continuous_bubble(run, per) if get(cfg, "continuous", False)
                            else _pipeline_bubble(steps, per))
    s.update(predict(run, steps))
    if not run.complete:
        notes.append("dump is not marked complete: the run crashed or this is a mid-run flush")
    return s
