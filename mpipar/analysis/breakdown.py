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
from .steps import StepChoice

COMPUTE_KINDS = ("F", "B", "W", "R", "LOSS", "OPT")
PIPE_COMPUTE = ("F", "B", "W", "R", "LOSS")  # model compute: the bubble's complement
COMM_AXES = ("pp", "tp", "dp", "world")  # kind prefixes "pp.", "tp.", ...

# self-time precedence: an instant covered by several events goes to the first listed
SELF_ORDER = COMM_AXES + COMPUTE_KINDS + ("other",)
SELF_COLUMNS = tuple(f"self_{k}" for k in SELF_ORDER)

RANK_COLUMNS = (
    ("rank", "dp", "pp", "tp", "step_time")
    + COMPUTE_KINDS
    + ("compute",)
    + tuple(f"comm_{a}" for a in COMM_AXES)
    + ("comm", "other", "busy", "exposed", "idle", "bubble")
    + SELF_COLUMNS
)


def union_length(starts, ends, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Total length covered by intervals [starts[i], ends[i]] clipped to [lo, hi], overlaps once."""
    s = np.clip(np.asarray(starts, dtype=float), lo, hi)
    e = np.clip(np.asarray(ends, dtype=float), lo, hi)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return 0.0
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    # running max of ends: an interval starts a new block when it begins after everything before it
    reach = np.maximum.accumulate(e)
    new_block = np.empty(s.size, dtype=bool)
    new_block[0] = True
    new_block[1:] = s[1:] > reach[:-1]
    block_id = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = np.zeros(block_start.size)
    np.maximum.at(block_end, block_id, e)
    return float(np.sum(block_end - block_start))


def select_steps(run: Run, step: int | None = None) -> tuple[list[int], list[str]]:
    """The steps to measure and notes on the choice (warm-up step 0 skipped when there are more;
    ``mpipar.analysis.steps``). A run loaded with a step choice (``load(steps=...)``) holds only
    those steps: its choice, unless ``step`` asks for one of them."""
    if step is None and run.selection is not None:
        steps, notes = run.selection
        return list(steps), list(notes)
    return StepChoice(step=step).choose(run.steps(), run.path)



def _kind_mask(kinds: np.ndarray, kind: str) -> np.ndarray:
    return kinds == kind


def _axis_mask(kinds: np.ndarray, axis: str) -> np.ndarray:
    return np.char.startswith(kinds, axis + ".")


def _by_step(ev: np.ndarray, steps: list[int]) -> list[np.ndarray]:
    """Events of each step, in recording order: one sort instead of a scan per step."""
    order = np.argsort(ev["step"], kind="stable")
    srt = ev[order]
    lo = np.searchsorted(srt["step"], steps, side="left")
    hi = np.searchsorted(srt["step"], steps, side="right")
    return [srt[a:b] for a, b in zip(lo, hi, strict=True)]


def _rank_step(ev: np.ndarray, notes: list, rank: int, step: int) -> dict:
    """The breakdown of one rank in one step (seconds); ``ev`` holds that step's events only."""
    kinds = ev["kind"]
    marker = ev[kinds == "STEP"]
    body = ev[kinds != "STEP"]
    if marker.size:
        lo, hi = float(marker["start"].min()), float(marker["end"].max())
    elif body.size:
        lo, hi = float(body["start"].min()), float(body["end"].max())
        notes.append(f"rank {rank} step {step}: no STEP event, step window = span of its events")
    else:
        return {}
    dur = body["end"] - body["start"]
    bkinds = body["kind"]
    out = {"step_time": hi - lo, "lo": lo, "hi": hi}
    is_compute = np.zeros(body.size, dtype=bool)
    for k in COMPUTE_KINDS:
        m = _kind_mask(bkinds, k)
        out[k] = float(dur[m].sum())
        is_compute |= m
    is_comm = np.zeros(body.size, dtype=bool)
    for a in COMM_AXES:
        m = _axis_mask(bkinds, a)
        out[f"comm_{a}"] = float(dur[m].sum())
        is_comm |= m
    out["compute"] = sum(out[k] for k in COMPUTE_KINDS)
    out["comm"] = sum(out[f"comm_{a}"] for a in COMM_AXES)
    out["other"] = float(dur[~is_compute & ~is_comm].sum())
    out["busy"] = union_length(body["start"], body["end"], lo, hi)
    compute_union = union_length(body["start"][is_compute], body["end"][is_compute], lo, hi)
    out["exposed"] = out["busy"] - compute_union
    out["idle"] = out["step_time"] - out["busy"]
    _self_times(out, body, bkinds, is_compute | is_comm, lo, hi)
    pipe = sum(out[k] for k in PIPE_COMPUTE)
    out["pipe_compute"] = pipe
    out["bubble"] = 1.0 - pipe / out["step_time"] if out["step_time"] > 0 else math.nan
    pm = np.isin(bkinds, PIPE_COMPUTE)
    out["pipe_lo"] = float(body["start"][pm].min()) if pm.any() else math.nan
    out["pipe_hi"] = float(body["end"][pm].max()) if pm.any() else math.nan
    return out


def _self_times(out: dict, body, kinds, known, lo: float, hi: float) -> None:
    """``self_<k>``: |k's intervals minus those of every kind before k in SELF_ORDER|."""
    covered_s = np.empty(0)
    covered_e = np.empty(0)
    covered = 0.0
    for k in SELF_ORDER:
        if k in COMM_AXES:
            m = _axis_mask(kinds, k)
        elif k == "other":
            m = ~known
        else:
            m = kinds == k
        covered_s = np.concatenate([covered_s, body["start"][m]])
        covered_e = np.concatenate([covered_e, body["end"][m]])
        # |k \ before| = |k U before| - |before|
        now = union_length(covered_s, covered_e, lo, hi)
        out[f"self_{k}"] = now - covered
        covered = now


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
    per = [
        [
            _rank_step(e, notes, r, s)
            for e, s in zip(_by_step(run.events[r], steps), steps, strict=True)
        ]
        for r in range(world)
    ]

    table = {
        "rank": np.arange(world),
        "dp": run.coords[:, 0].copy(),
        "pp": run.coords[:, 1].copy(),
        "tp": run.coords[:, 2].copy(),
    }
    value_cols = [c for c in RANK_COLUMNS if c not in table]
    for c in value_cols:
        table[c] = np.array(
            [
                np.mean([d[c] for d in per[r] if d]) if any(per[r]) else math.nan
                for r in range(world)
            ]
        )
    missing = [r for r in range(world) if not any(per[r])]
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


def _step_times(steps, per, continuous=False) -> np.ndarray:
    """Per step, first STEP start to last STEP end over all ranks; a continuous run's ranks
    never meet between steps (one stage runs its call of a step a little ahead of the other's),
    so there the longest rank's own call."""
    out = []
    for i in range(len(steps)):
        rows = [p[i] for p in per if p[i]]
        if rows and continuous:
            out.append(max(d["hi"] - d["lo"] for d in rows))
        elif rows:
            out.append(max(d["hi"] for d in rows) - min(d["lo"] for d in rows))
    return np.array(out)


def _continuous_bubble(run, per) -> float:
    """The pipeline bubble of a continuous run (PipeDream without a flush): consecutive steps'
    micro-batches overlap and the ranks never meet, so neither a per-step window nor one window
    over all ranks fits. Per rank, 1 - its model compute inside its measured steps' calls / the
    calls' total span (between calls: dump flushes, progress lines, not the pipeline's), mean
    over ranks (``predict_continuous`` simulates the same)."""
    vals = []
    for r, ev in enumerate(run.events):
        calls = [(d["lo"], d["hi"]) for d in per[r] if d]
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
    vals = []
    for i in range(len(steps)):
        rows = [p[i] for p in per if p[i]]
        timed = [d for d in rows if not math.isnan(d["pipe_lo"])]
        if not timed:
            continue
        lo = min(d["pipe_lo"] for d in timed)
        hi = max(d["pipe_hi"] for d in timed)
        if hi > lo:
            vals.extend(1.0 - d["pipe_compute"] / (hi - lo) for d in rows)
    return float(np.mean(vals)) if vals else math.nan


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
