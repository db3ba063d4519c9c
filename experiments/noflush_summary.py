"""The flush / no-flush comparison of ``noflush_ab.sh``, per configuration and round.

usage: python experiments/noflush_summary.py OUT

For every run ``OUT/r<round>_<cfg>_m<m>_<schedule>`` it reads the dump (``mpipar.analysis``)
and prints the measured bubble (each rank's share of its step not in model compute, mean over
ranks), the pipeline bubble (``b_calls``; a continuous run: the same over each rank's calls)
and its calibrated prediction (a continuous run: ``predict_continuous``, the simulation on the
costs fitted from that dump), the step time
measured and predicted, and tokens/s; a continuous row also its bubble and tokens/s against
the 1F1B run of the same round, configuration and m, and whether it meets the bar: bubble at
least ``BUBBLE_GAIN`` below 1F1B's and within ``PRED_TOL`` of its own prediction, tokens/s at
least ``SPEED_GAIN`` above 1F1B's. The speed-up is judged on wall-clock tokens/s (``wall_tok``:
each rank's STEP ends from the first measured step to the last, gaps between steps included
(and any dump flush: ``noflush_ab.sh`` flushes only at the end), mean over ranks), which needs
no definition of a continuous run's step;
``tok/s`` is the analysis's (per-step) figure beside it.

A second table (``noflush_feasible``) says, per continuous row, what the simulator on the two
runs' fitted costs predicts it gains over its 1F1B run (with and without the per-action
overhead, and at most, every term it pays beyond 1F1B at 1F1B's value) and which of those terms
(per-micro-batch updates, weight-version work, per-action overhead, slower units) eats the gain.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from mpipar.analysis import breakdown, load
from mpipar.analysis.flops import tokens_per_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import noflush_feasible  # noqa: E402  (beside this script)

BUBBLE_GAIN, PRED_TOL, SPEED_GAIN = 0.03, 0.015, 0.05
NAME = re.compile(r"r(\d+)_(\w+?)_m(\d+)_(.+)$")


def rows(out: Path) -> list[dict]:
    found = []
    for d in sorted(out.iterdir()):
        m = NAME.match(d.name)
        if not (m and (d / "trace.h5").exists()):
            continue
        found.append({"round": int(m[1]), "cfg": m[2], "m": int(m[3]), "sched": m[4],
                      **_measures(d)})
    return found


def _measures(d: Path) -> dict:
    """A run's numbers, kept beside its dump (``noflush_row.json``, made again when the dump
    changed): the figure reads the runs the summary has just analysed."""
    trace = d / "trace.h5"
    cache = d / "noflush_row.json"
    stamp = trace.stat().st_mtime_ns
    if cache.exists():
        try:
            got = json.loads(cache.read_text())
            if got.pop("stamp", None) == stamp:
                return got
        except (ValueError, OSError):
            pass
    s = breakdown(str(trace))["summary"]
    out = {"bubble": s["bubble"], "bubble_pipe": s["bubble_pipeline"],
           "bubble_pred": _num(s.get("bubble_pred")), "step_ms": 1e3 * s["step_time"],
           "step_pred_ms": 1e3 * _num(s.get("step_time_pred")), "tok_s": s["tokens_per_s"],
           "wall_tok_s": wall_tokens_per_s(str(trace))}
    try:
        cache.write_text(json.dumps({**out, "stamp": stamp}))
    except OSError:
        pass  # a read-only folder: analysed again next time
    return out


def wall_tokens_per_s(path: str) -> float:
    """Tokens per wall-clock second between the ends of the first and the last measured step
    (step 0, the warm-up, left out), per rank, mean over ranks."""
    run = load(path)
    rates = []
    for ev in run.events:
        ends = np.sort(ev["end"][(ev["kind"] == "STEP") & (ev["step"] >= 1)])
        if ends.size >= 2:
            rates.append((ends.size - 1) / (ends[-1] - ends[0]))
    return tokens_per_step(run.config) * float(np.mean(rates)) if rates else math.nan


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def verdicts(found: list[dict]) -> None:
    """Adds, to each continuous row, its gains over the matching 1F1B row and the verdict."""
    base = {(r["round"], r["cfg"], r["m"]): r for r in found if r["sched"] == "1f1b"}
    for r in found:
        ref = base.get((r["round"], r["cfg"], r["m"]))
        if r["sched"] == "1f1b" or ref is None:
            continue
        r["d_bubble"] = r["bubble"] - ref["bubble"]
        r["speedup"] = r["tok_s"] / ref["tok_s"] - 1
        r["wall_speedup"] = r["wall_tok_s"] / ref["wall_tok_s"] - 1
        # the prediction simulates a continuous run's bubble over its calls (bubble_pipe)
        r["ok"] = (r["d_bubble"] <= -BUBBLE_GAIN and r["wall_speedup"] >= SPEED_GAIN
                   and abs(r["bubble_pred"] - r["bubble_pipe"]) <= PRED_TOL)


def feasible(out: Path, found: list[dict]) -> None:
    """Adds ``feasible`` (``noflush_feasible.feasibility``) to each continuous row that has a
    1F1B run in its round, kept beside its dump (``noflush_feasible.json``, made again when
    either dump changed)."""
    for r in found:
        if "ok" not in r:
            continue
        pre = f"r{r['round']}_{r['cfg']}_m{r['m']}_"
        d, ref = out / (pre + r["sched"]), out / (pre + "1f1b")
        stamp = [(x / "trace.h5").stat().st_mtime_ns for x in (d, ref)]
        cache = d / "noflush_feasible.json"
        try:
            got = json.loads(cache.read_text())
            if got.pop("stamp", None) == stamp:
                r["feasible"] = got
                continue
        except (ValueError, OSError):
            pass
        try:
            r["feasible"] = noflush_feasible.feasibility(d, ref)
        except Exception as exc:  # a dump the fit cannot use: the row says so, the rest goes on
            print(f"{d.name}: no feasibility ({exc.__class__.__name__}: {exc})")
            continue
        try:
            cache.write_text(json.dumps({**r["feasible"], "stamp": stamp}))
        except OSError:
            pass  # a read-only folder: worked out again next time


def pct(x) -> str:
    return "" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def main(out: Path) -> None:
    found = rows(out)
    verdicts(found)
    head = (f"{'run':34s} {'bubble':>7s} {'b_calls':>7s} {'b_pred':>7s} {'step_ms':>8s} "
            f"{'pred_ms':>8s} {'tok/s':>9s} {'wall_tok':>9s} {'d_bub':>7s} {'speedup':>8s} "
            f"{'wall_su':>8s}  bar")
    print(head)
    print("-" * len(head))
    for r in found:
        name = f"r{r['round']}_{r['cfg']}_m{r['m']}_{r['sched']}"
        print(f"{name:34s} {pct(r['bubble']):>7s} {pct(r['bubble_pipe']):>7s} "
              f"{pct(r['bubble_pred']):>7s} {r['step_ms']:8.2f} {r['step_pred_ms']:8.2f} "
              f"{r['tok_s']:9.3e} {r['wall_tok_s']:9.3e} {pct(r.get('d_bubble')):>7s} "
              f"{pct(r.get('speedup')):>8s} {pct(r.get('wall_speedup')):>8s}  "
              f"{'' if 'ok' not in r else ('met' if r['ok'] else 'not met')}")
    feasible(out, found)
    print("\npredicted tokens/s gain over the round's 1F1B (fitted costs, simulated), and the "
          "terms that eat it (noflush_feasible.py):")
    print("\n".join(noflush_feasible.table(found)))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python experiments/noflush_summary.py OUT (the folder noflush_ab.sh "
                 "wrote)")
    main(Path(sys.argv[1]))
