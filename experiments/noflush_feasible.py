"""How much a continuous run can gain over 1F1B on this machine, from the two runs' dumps.

usage: python experiments/noflush_feasible.py CONT_RUN 1F1B_RUN  (or through noflush_summary.py)

Each run's costs are fitted from its own dump (the continuous one: ``predict_continuous._model``,
the 1F1B one: ``predict.run_model``) and its schedule replayed by the project's simulator,
jitter-free; the period of a step is what ``noflush_summary.wall_tokens_per_s`` measures:
from the end of one step to the end of the next, on each rank, mean over ranks (the 1F1B step
plus its measured mean gap between steps; a continuous run's calls with the time between them).
Predicted tokens/s gains of the continuous run over 1F1B:

- ``pred``: both on their fitted costs;
- ``no_ovh``: both without the per-action overhead (dispatch, posting and testing requests);
- ``bound``: the continuous run with every term it pays beyond 1F1B given 1F1B's value (below):
  what removing the flush is worth here, with the stages as unbalanced as they are.

The terms (ms per step, the continuous period's drop when that one term takes 1F1B's value):
``opt``: its UPDATEs cost, per step and chunk, 1F1B's one optimizer step (PipeDream updates once
per micro-batch); ``stash``: no weight-version work; ``ovh``: 1F1B's per-action overhead;
``units``: 1F1B's F and backward costs (a continuous run's units are measured slower: the update
and the copies between them leave the caches cold; between two runs, the machine's drift too);
``fixed``: 1F1B's time before and after the actions of a step and its mean time between steps
(the training loop's own work, dump flushes included), for each call (the lagged reduction
kept). ``imbal``: the busiest rank's compute per
step less the mean over ranks (no schedule hides it: the period is at least the busiest
rank's). Load-independent in the sense that matters: both runs' costs come from their dumps,
so a slower machine moves both sides alike.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

TERMS = ("opt", "stash", "ovh", "units", "fixed")


def _period_cont(sched, model, order, cuts, steps) -> tuple[float, float]:
    """(period per step, mean over ranks; the busiest rank's compute per step less the
    mean) of continuous ``sched`` on ``model`` over ``steps``."""
    from mpipar.parallel.pipeline.simulate import simulate_steps

    sim, _ = simulate_steps(sched, model, order, cuts)
    k0, k1 = min(steps), max(steps)
    periods, busy = [], []
    for r, tl in enumerate(sim.timeline):
        ends = [tl[cuts[r][k] - 1][1] for k in (k0 - 1, k1)]  # call k's last action
        periods.append((ends[1] - ends[0]) / (k1 - k0 + 1))
        calls = tl[cuts[r][k0 - 1]:cuts[r][k1]]
        busy.append(sum(b - a for a, b, act in calls if act.op in ("F", "B", "W", "BW"))
                    / (k1 - k0 + 1))
    return float(np.mean(periods)), max(busy) - float(np.mean(busy))


def _gap_1f1b(run, steps) -> float:
    """Mean time between one STEP marker's end and the next one's start, mean over ranks."""
    gaps = []
    for ev in run.events:
        mk = np.sort(ev[(ev["kind"] == "STEP") & np.isin(ev["step"], steps)], order="step")
        if mk.size >= 2:
            gaps.append(float(np.mean(mk["start"][1:] - mk["end"][:-1])))
    return float(np.mean(gaps)) if gaps else 0.0


def _no_overhead(model, value=0.0):
    """``model`` with the per-action overhead ``value`` on every rank and call."""
    return replace(model, overhead=value,
                   per_rank={k: v for k, v in model.per_rank.items() if k[1] != "overhead"},
                   call_part={k: v for k, v in model.call_part.items() if k[2] != "overhead"})


def _as_1f1b(term, cont, ref, sched, gap):
    """``cont`` with ``term`` (``TERMS``) at 1F1B's (``ref``; ``gap``: its mean time between
    steps) value (module doc)."""
    if term == "fixed":
        keep = ("overhead", "sync")
        return replace(cont, step_pre=ref.step_pre, step_post=ref.step_post, step_gap=gap,
                       call_gap={},
                       per_rank={k: v for k, v in cont.per_rank.items() if k[1] in keep},
                       call_part={k: v for k, v in cont.call_part.items() if k[2] in keep})
    if term == "stash":
        return replace(cont, stash={})
    if term == "ovh":
        return _no_overhead(cont, ref.overhead)
    upd = {}  # UPDATEs per step and chunk on each rank
    for p, acts in enumerate(sched.ranks):
        for a in acts:
            if a.op == "UPDATE" and a.mb < sched.microbatches:
                upd[(p, a.chunk)] = upd.get((p, a.chunk), 0) + 1
    if term == "opt":
        per = {(p, c, "UPDATE"): ref.optimizer.get(p, 0.0) / n for (p, c), n in upd.items()}
        return replace(cont, per_unit=cont.per_unit | per,
                       step_unit={k: v for k, v in cont.step_unit.items() if k[3] != "UPDATE"})
    if term == "units":
        units = {k: v for k, v in ref.per_unit.items() if k[2] != "UPDATE"}
        return replace(cont, per_unit=cont.per_unit | units,
                       step_unit={k: v for k, v in cont.step_unit.items() if k[3] == "UPDATE"},
                       jitter=(), rank_jitter={})
    raise ValueError(f"unknown term {term!r}; known: {', '.join(TERMS)}")


def feasibility(cont_dir: Path, ref_dir: Path) -> dict:
    """{pred, no_ovh, bound: predicted tokens/s gain of the continuous run over 1F1B; the
    ``TERMS`` and imbal: ms per step} (module doc)."""
    from mpipar.analysis import load
    from mpipar.analysis.breakdown import select_steps
    from mpipar.analysis.flops import setting as get
    from mpipar.analysis.predict import run_model
    from mpipar.analysis.predict_continuous import _model
    from mpipar.parallel.pipeline.simulate import simulate

    cont, ref = load(str(cont_dir / "trace.h5")), load(str(ref_dir / "trace.h5"))
    c_steps, _ = select_steps(cont)
    r_steps, _ = select_steps(ref)
    pp, m = int(cont.grid["pp"]), int(get(cont.config, "microbatches"))
    sched, cm, _, _, order, cuts = _model(cont, c_steps, get(cont.config, "schedule"), pp, m)
    r_sched, rm, _, _ = run_model(ref, r_steps, get(ref.config, "schedule"), pp,
                                  int(get(ref.config, "microbatches")), 1)
    gap = _gap_1f1b(ref, r_steps)

    def t_ref(model):
        return simulate(r_sched, model).step_time + gap

    def t_cont(model):
        return _period_cont(sched, model, order, cuts, c_steps)[0]

    base, imbal = _period_cont(sched, cm, order, cuts, c_steps)
    out = {"pred": t_ref(rm) / base - 1,
           "no_ovh": t_ref(_no_overhead(rm)) / t_cont(_no_overhead(cm)) - 1,
           "imbal": 1e3 * imbal}
    best = cm
    for term in TERMS:
        out[term] = 1e3 * (base - t_cont(_as_1f1b(term, cm, rm, sched, gap)))
        best = _as_1f1b(term, best, rm, sched, gap)
    out["bound"] = t_ref(rm) / t_cont(best) - 1
    return out


def pct(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def table(rows: list[dict]) -> list[str]:
    """Lines of the feasibility table: each continuous row of ``noflush_summary`` with its
    measured wall-clock gain (``wall_speedup``) and ``feasible`` (this module's dict)."""
    head = (f"{'run':34s} {'measured':>8s} {'pred':>7s} {'no_ovh':>7s} {'bound':>7s}  "
            + " ".join(f"{t:>6s}" for t in (*TERMS, "imbal")) + "  (terms: ms/step)")
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r.get("feasible")
        if f is None:
            continue
        name = f"r{r['round']}_{r['cfg']}_m{r['m']}_{r['sched']}"
        lines.append(f"{name:34s} {pct(r.get('wall_speedup')):>8s} {pct(f['pred']):>7s} "
                     f"{pct(f['no_ovh']):>7s} {pct(f['bound']):>7s}  "
                     + " ".join(f"{f[t]:6.2f}" for t in (*TERMS, "imbal")))
    return lines


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]]
    if len(dirs) != 2 or not all((d / "trace.h5").exists() for d in dirs):
        sys.exit("usage: python experiments/noflush_feasible.py CONT_RUN 1F1B_RUN (each a "
                 "folder with a trace.h5, e.g. OUT/r1_tiny_m8_pipedream-cont and "
                 "OUT/r1_tiny_m8_1f1b of noflush_ab.sh)")
    got = feasibility(*dirs)
    print(" ".join(f"{k} {pct(v) if k in ('pred', 'no_ovh', 'bound') else f'{v:.2f} ms'}"
                   for k, v in got.items()))
