"""Breakdowns as text tables, CSV and JSON (what ``mpipar analyze`` prints)."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np

from .bandwidth import bandwidth_text
from .breakdown import RANK_COLUMNS
from .compare import COMPARE_COLUMNS, to_jsonable

# per-rank text table: (column, header), ms per step. Self times (each instant once, see
# mpipar.analysis.breakdown) so a row adds up: step = compute + communication + other + idle.
TEXT_RANK_COLUMNS = (
    ("step_time", "step"),
    ("self_F", "F"),
    ("self_B", "B"),
    ("self_W", "W"),
    ("self_R", "R"),
    ("self_LOSS", "LOSS"),
    ("self_OPT", "OPT"),
    ("self_pp", "pp"),
    ("self_tp", "tp"),
    ("self_dp", "dp"),
    ("self_world", "world"),
    ("self_other", "other"),
    ("idle", "idle"),
    ("bubble", "bubble"),
)
FRACTIONS = {
    "bubble",
    "bubble_pipeline",
    "bubble_sim",
    "bubble_textbook",
    "bubble_pred",
    "bubble_step_pred",
    "mfu",
    "compute_frac",
    "exposed_frac",
    "idle_frac",
    "comm_frac",
}


def fmt(value, column: str = "") -> str:
    """Numbers for people: fractions as %, seconds as ms, rates in engineering notation."""
    if value is None or isinstance(value, str):
        return "n/a" if value in (None, "") else value
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    v = float(value)
    if math.isnan(v):
        return "n/a"
    if column in FRACTIONS:
        return f"{100 * v:.1f}%"
    if column.startswith(("flops", "peak")) or column == "tokens_per_s":
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    if column == "step_time" or column in dict(TEXT_RANK_COLUMNS) or column.startswith("comm"):
        return _ms(v)
    return f"{v:.4g}"


def _ms(seconds: float) -> str:
    """Seconds as milliseconds with about 4 significant digits, never in exponent notation."""
    ms = 1e3 * seconds
    if abs(ms) >= 1000:
        return f"{ms:.0f}"
    if abs(ms) >= 10:
        return f"{ms:.1f}"
    return f"{ms:.3g}" if abs(ms) >= 1e-3 or ms == 0 else f"{ms:.1e}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(
        h.rjust(w) if i else h.ljust(w)
        for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    )
    out = [line, "-" * len(line)]
    for r in rows:
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(out)


def rank_table_text(result: dict) -> str:
    t = result["ranks"]
    headers = ["rank"] + [h for _, h in TEXT_RANK_COLUMNS]
    rows = []
    for i in range(len(t["rank"])):
        label = f"r{t['rank'][i]} dp{t['dp'][i]}/pp{t['pp'][i]}/tp{t['tp'][i]}"
        rows.append([label] + [fmt(t[c][i], c) for c, _ in TEXT_RANK_COLUMNS])
    return _table(headers, rows)


def summary_text(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"run {s['run']}  ({result['path']})",
        f"  grid dp={s['dp']} pp={s['pp']} tp={s['tp']} ({s['world_size']} ranks), schedule "
        f"{s['schedule']}, microbatches {fmt(s['microbatches'])}, virtual "
        f"{fmt(s['virtual_stages'])}, "
        f"model {s['model']}, {s['dtype']} on {s['device']}",
        "  " + "; ".join(result["notes"]),
        f"  step time {fmt(s['step_time'], 'step_time')} ms, tokens/step "
        f"{fmt(s['tokens_per_step'])}, "
        f"tokens/s {fmt(s['tokens_per_s'], 'tokens_per_s')}",
        f"  model FLOPs/step {fmt(s['flops_per_step'], 'flops')} (N={fmt(s['n_params'])}), "
        f"achieved {fmt(s['flops_per_s'], 'flops')} FLOP/s, MFU {fmt(s['mfu'], 'mfu')}",
        f"  peak used: {fmt(s['peak'], 'peak')} FLOP/s per device x {s['devices']} device(s), "
        f"from {s['peak_source']}",
        f"  time shares (mean over ranks): compute {fmt(s['compute_frac'], 'compute_frac')}, "
        f"exposed comm {fmt(s['exposed_frac'], 'exposed_frac')}, "
        f"idle {fmt(s['idle_frac'], 'idle_frac')}",
        f"  bubble: measured {fmt(s['bubble'], 'bubble')} (1 - F+B+W+R+LOSS / step), "
        f"pipeline window "
        f"{fmt(s['bubble_pipeline'], 'bubble')}, simulated {fmt(s['bubble_sim'], 'bubble')}, "
        f"textbook {fmt(s['bubble_textbook'], 'bubble')}",
    ]
    c = s["costs"]
    lines.append("  measured costs (ms): " + ", ".join(f"{k} {_ms(v)}" for k, v in c.items()))
    if s.get("predict_note"):
        lines.append(f"  prediction: {s['predict_note']}")
    if isinstance(s.get("predicted"), dict):
        lines.append(prediction_text(result))
    if "planned" in s or "planned_note" in s:
        lines.append(three_columns_text(result))
    return "\n".join(lines)


def _diff(pred, meas, pct=False) -> str:
    if not isinstance(pred, (int, float)) or not isinstance(meas, (int, float)):
        return "n/a"
    if pct:
        return f"{100 * (pred - meas):+.1f} pts"
    return f"{100 * (pred - meas) / meas:+.1f}%" if meas else "n/a"


def prediction_text(result: dict) -> str:
    """Predicted (calibrated cost model) beside measured: step, bubble, per pipeline rank."""
    s, t = result["summary"], result["ranks"]
    pr = s["predicted"]
    rows = [
        ["step time (ms)", _ms(s["step_time"]), _ms(s["step_time_pred"]),
         _diff(s["step_time_pred"], s["step_time"])],
        ["bubble (pipeline window)", fmt(s["bubble_pipeline"], "bubble"),
         fmt(s["bubble_pred"], "bubble"), _diff(s["bubble_pred"], s["bubble_pipeline"], True)],
    ]
    if "bubble_step_pred" in s:  # (a continuous run's steps overlap: no per-step bubble)
        rows.append(["bubble (whole step)", fmt(s["bubble"], "bubble"),
                     fmt(s["bubble_step_pred"], "bubble"),
                     _diff(s["bubble_step_pred"], s["bubble"], True)])
    mem = s.get("memory_measured")
    for p in range(len(pr["compute"])):
        on = t["pp"] == p
        comp = float(np.nanmean(sum(t[k][on] for k in ("F", "B", "W", "R", "LOSS"))))
        rows.append([f"pp{p} compute (ms)", _ms(comp), _ms(pr["compute"][p]),
                     _diff(pr["compute"][p], comp)])
        if pr.get("comm"):
            # the model carries tp collectives inside the unit costs (compute, inclusive, as
            # measured above): its communication is what lies outside the units
            comm = float(np.nanmean(t["comm"][on] - t["comm_tp"][on]))
            rows.append([f"pp{p} communication outside units (ms)", _ms(comm),
                         _ms(pr["comm"][p]), _diff(pr["comm"][p], comm)])
        if pr.get("memory"):
            got = float(np.mean(np.asarray(mem)[on])) if mem else None
            rows.append([f"pp{p} peak memory (MiB)", f"{got / 2**20:.1f}" if got else "n/a",
                         f"{pr['memory'][p] / 2**20:.1f}", _diff(pr["memory"][p], got)])
    m = pr["model"]
    fitted = (f"  fitted: overhead/action {_us(m['overhead'])}, send post {_us(m['send_post'])}, "
              f"recv {_us(m['recv_post'])}, p2p latency {_us(m['latency'])}, sync "
              f"{_us(m['sync'])}, step pre/post {_us(m['step_pre'])}/{_us(m['step_post'])}, "
              f"compute jitter cv {m.get('jitter_cv', 0.0):.3f} ({m.get('samples', 1)} draws)")
    if pr.get("continuous_steps"):
        fitted += (f"\n  continuous: its lists over {pr['continuous_steps']} steps, run a step at "
                   "a time, each rank's calls back to back (no meeting between steps)")
        if m.get("step_unit_steps"):
            cv = ", ".join(f"pp{p} {v:.3f}" for p, v in m.get("step_unit_cv", {}).items())
            fitted += (f"; each of {m['step_unit_steps']} steps costs its own unit means "
                       f"(their spread over steps, cv: {cv}), each call its own overhead, "
                       "time before and after it and in the lagged reduction")
    table = _table(["predicted vs measured", "measured", "predicted", "diff"], rows)
    return "  calibrated cost model (fitted from unit durations, mpipar.analysis.costmodel):\n" + \
        "\n".join("  " + line for line in table.splitlines()) + "\n" + fitted + \
        _memory_parts(pr.get("memory_parts"))


def _mean_on(values, on) -> float | None:
    return float(np.nanmean(np.asarray(values, float)[on])) if values is not None else None


def _pick(pred: dict, key: str, p: int):
    return pred[key][p] if pred.get(key) and p < len(pred[key]) else None


def three_columns_text(result: dict) -> str:
    """Measured | calibrated (fitted from this dump) | planned (from a cluster spec alone, no
    dump: ``mpipar.plan.here``): the same simulator and memory model on two sources of costs.
    Per pipeline rank, compute counts F, B, W, R and LOSS (tp collectives inside them), as the
    calibrated model does; communication is what lies outside the units."""
    s, t = result["summary"], result["ranks"]
    if "planned" not in s:
        return "  " + s.get("planned_note", "planned: n/a")
    pl, pr = s["planned"], s.get("predicted") if isinstance(s.get("predicted"), dict) else {}

    def row(name, meas, cal, plan, unit="ms"):
        show = {"ms": lambda x: _ms(x), "%": lambda x: fmt(x, "bubble"),
                "MiB": lambda x: f"{x / 2**20:.1f}"}[unit]
        cells = [show(x) if isinstance(x, (int, float)) else "n/a" for x in (meas, cal, plan)]
        return [f"{name} ({unit})", *cells, _diff(plan, meas, pct=unit == "%")]

    rows = [row("step time", s["step_time"], s.get("step_time_pred"), pl["step"]),
            row("bubble (pipeline window)", s["bubble_pipeline"], s.get("bubble_pred"),
                pl["bubble"], "%")]
    mem = s.get("memory_measured")
    for p in range(len(pl["compute"])):
        on = t["pp"] == p
        comp = float(np.nanmean(sum(t[k][on] for k in ("F", "B", "W", "R", "LOSS"))))
        comm = float(np.nanmean(t["comm"][on] - t["comm_tp"][on]))
        rows.append(row(f"pp{p} compute", comp, _pick(pr, "compute", p), pl["compute"][p]))
        rows.append(row(f"pp{p} communication", comm, _pick(pr, "comm", p), pl["comm"][p]))
        rows.append(row(f"pp{p} peak memory", _mean_on(mem, on), _pick(pr, "memory", p),
                        pl["memory"][p] if pl.get("memory") else None, "MiB"))
    table = _table(["measured | calibrated | planned", "measured", "calibrated", "planned",
                    "planned-measured"], rows)
    return (f"  planned from cluster spec {pl.get('spec', '?')} (mpipar.plan.here: the calibrated "
            "path's simulator and memory model, costs from FLOPs, bytes and the spec):\n"
            + "\n".join("  " + line for line in table.splitlines()))


def _memory_parts(parts) -> str:
    """The memory model's parts per pipeline rank (mpipar.analysis.memory_model), in MiB; the
    measured peak is mem.static + mem.peak - mem.base (mpipar.training.memory)."""
    if not parts:
        return ""
    each = []
    for p, r in enumerate(parts):
        state = (r["params"] + r["grads"] + r["optimizer"]) / 2**20
        each.append(f"pp{p} state {state:.1f} + activations {r['activations'] / 2**20:.1f} + "
                    f"working set {r['work'] / 2**20:.1f} + buffers {r['buffers'] / 2**20:.1f}"
                    + (f" + next batch {r['prefetch'] / 2**20:.2f}" if "prefetch" in r else "")
                    + (f" + timing dump {r['trace'] / 2**20:.1f}" if "trace" in r else ""))
    runtime = {r.get("runtime") for r in parts} - {None}
    line = ""
    if runtime:  # one number per machine, the same on every rank
        line = ("\n  runtime (MPI, BLAS, allocator; measured once per machine): "
                f"{max(runtime) / 2**20:.1f} MiB a rank")
    return ("\n  memory model (MiB): " + "; ".join(each) + line + "\n  (modelled from the "
            "config: state, activations, working set, buffers; the timing dump from two "
            "constants and the runtime from one, measured per machine by "
            "experiments/memory_runtime.py; see mpipar.analysis.memory_model and "
            "mpipar.training.memory)")


def _us(seconds) -> str:
    return f"{1e6 * seconds:.0f} us" if isinstance(seconds, (int, float)) else "n/a"


def comparison_text(table: dict) -> str:
    headers = list(COMPARE_COLUMNS)
    n = len(table["run"])
    rows = [[fmt(table[c][i], c) for c in headers] for i in range(n)]
    short = {
        "world_size": "ranks",
        "microbatches": "mb",
        "virtual_stages": "v",
        "step_time": "step_ms",
        "tokens_per_s": "tok/s",
        "flops_per_s": "FLOP/s",
        "compute_frac": "compute",
        "exposed_frac": "exposed",
        "idle_frac": "idle",
        "bubble_pipeline": "bub_pipe",
        "bubble_sim": "bub_sim",
        "bubble_textbook": "bub_text",
    }
    return _table([short.get(h, h) for h in headers], rows)


def to_text(results: list, table: dict) -> str:
    parts = []
    for res in results:
        parts.append(summary_text(res))
        parts.append(
            "per rank, ms per step, self time (each instant once; a collective inside F is "
            "counted as communication); bubble = 1 - (F+B+W+R+LOSS, inclusive) / step:"
        )
        parts.append(rank_table_text(res))
        parts += [t for t in [bandwidth_text(res["path"], res["steps"], res.get("bandwidth")),
                              res.get("links", "")] if t]
        parts.append("")
    parts.append("comparison:")
    parts.append(comparison_text(table))
    return "\n".join(parts) + "\n"


def to_csv(results: list, table: dict) -> str:
    """Per-rank rows of every run (seconds per step), a blank line, then the comparison rows."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["run", *RANK_COLUMNS])
    for res in results:
        t = res["ranks"]
        for i in range(len(t["rank"])):
            w.writerow([res["run"], *(_csv_value(t[c][i]) for c in RANK_COLUMNS)])
    w.writerow([])
    w.writerow(list(COMPARE_COLUMNS))
    for i in range(len(table["run"])):
        w.writerow([_csv_value(table[c][i]) for c in COMPARE_COLUMNS])
    return buf.getvalue()


def _csv_value(v):
    v = to_jsonable(v)
    return "" if v is None else v


def to_json(results: list, table: dict) -> str:
    runs = []
    for res in results:
        t = res["ranks"]
        rows = [{c: t[c][i] for c in RANK_COLUMNS} for i in range(len(t["rank"]))]
        runs.append(
            {
                "run": res["run"],
                "path": res["path"],
                "steps": res["steps"],
                "notes": res["notes"],
                "summary": res["summary"],
                "ranks": rows,
            }
        )
    comparison = [{c: table[c][i] for c in COMPARE_COLUMNS} for i in range(len(table["run"]))]
    return json.dumps(to_jsonable({"runs": runs, "comparison": comparison}), indent=2) + "\n"
