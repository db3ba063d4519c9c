"""The bubble a schedule simulator predicts for a run, from the run's own measured costs.

The **predicted bubble** is ``mpipar.parallel.pipeline.simulate`` on the run's schedule with the
measured mean per-chunk F, B, W costs, times ``virtual_stages`` since the simulator takes
per-stage costs (``BW = B + W``; recomputation R is added to B; with no W events, B already is
the whole backward and W = 0), and as ``comm`` the median ``pp.send``/``pp.recv`` duration
(median: blocking receives that sat in a bubble are long outliers). ``bubble_textbook`` is the
closed formula (e.g. (p-1)/(m+p-1) for GPipe).
"""

from __future__ import annotations

import numpy as np

from .dump import Run
from .flops import setting as get


def measured_costs(run: Run, steps) -> dict:
    """Mean per-chunk F, B, W (and BW) durations and the median p2p transfer time, in seconds."""
    ev = np.concatenate(run.events) if run.events else np.empty(0)
    ev = ev[np.isin(ev["step"], steps)]
    dur = ev["end"] - ev["start"]
    kinds = ev["kind"]

    def mean(k):
        m = kinds == k
        return float(dur[m].mean()) if m.any() else 0.0

    f, b, w, r = mean("F"), mean("B"), mean("W"), mean("R")
    p2p = dur[np.isin(kinds, ("pp.send", "pp.recv"))]
    comm = float(np.median(p2p)) if p2p.size else 0.0
    return {"F": f, "B": b + r, "W": w, "BW": b + r + w, "comm": comm}


def predict(run: Run, steps) -> dict:
    """Simulator and textbook bubble for the run's schedule; "n/a" + reason if unavailable."""
    cfg = run.config
    kind = get(cfg, "schedule")
    pp = int(run.grid["pp"])
    m = get(cfg, "microbatches")
    v = int(get(cfg, "virtual_stages", 1) or 1)
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
        sim = simulate(build_schedule(kind, pp, int(m), virtual_stages=v), costs=stage_costs)
        out["bubble_sim"] = float(sim.bubble_fraction)
        out["sim_makespan"] = float(sim.makespan)
        out["sim_peak_activations"] = sim.peak_activations
    except Exception as exc:
        out["predict_note"] += f"simulate failed ({exc.__class__.__name__}: {exc})"
    return out
