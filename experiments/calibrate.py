"""Experiment: the calibrated cost model against measurement, at pp = 2 and for tp = 2, dp = 2.

For pp = 2, every schedule bubble.py measures (naive, GPipe, 1F1B, interleaved v = 2, ZB-H1 and
the 2023-2025 ones, PipeDream-2BW, continuous PipeDream / 2BW) and m in 1, 2, 4, 8 (where
valid), plus one tp = 2 and one dp = 2 run (1F1B on one stage, m = 4), it trains the GPT of
experiments/configs/exp_bubble.toml and puts side by side:

- measured: ``bubble_pipeline`` (1 - model compute / pipeline window) and the step time, from
  ``mpipar.analysis.breakdown``;
- predicted: the simulator on the ``CostModel`` fitted by ``mpipar.analysis.costmodel``. What is
  fitted from what: per (rank, chunk) F / B / W from the unit events (F + LOSS, B + R), the
  per-action overhead from the gaps between a rank's pipeline events, send/receive posting from
  ``pp.send`` / ``pp.recv`` / ``pp.wait``, the p2p latency from receives that waited for their
  send (each matched to its own send), dp reductions from ``dp.*`` (one simulation per dp
  replica and tp rank, each on its own unit costs), optimizer and fixed per-step costs from
  ``OPT`` and ``STEP``; the compute jitter (the spread of one unit's duration around its
  kind's mean within a step: every compute of a simulation draws one, and the prediction is
  the mean over 32 seeded draws); step by step, averaged, as the measurement is. Continuous
  runs (``-cont``): their lists run a step at a time, the ranks meeting in each step's world
  all-reduce (``mpipar.analysis.predict_continuous``).
  Nothing is fitted to the step time or the bubble of a row: those are what the row checks.
- the uniform prediction (one cost per kind for all ranks, the model before calibration) and the
  textbook formula.

Targets (quiet machine): |bubble error| <= 1.5 points, step error within 10 % (continuous
rows: 5 %). ``--continuous`` runs only the continuous rows (PipeDream and 2BW without a flush,
m = 2, 4, 8: six runs, about 2 minutes on 2 idle cores).
Column ``contention``: set where the row's units ran markedly slower beside the other rank's
compute than alone (``mpipar.analysis.contention``): on this 2-vCPU VM that comes and goes, and
the simulator has no term for it, so such a row's bubble is measured below its prediction.
The mark changes no result; it says which rows to rerun alone.
Run: ``python experiments/calibrate.py [--quick] [--out DIR]`` (it starts mpiexec itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bubble  # noqa: E402
import common  # noqa: E402

NAME = "calibrate"
COLUMNS = ["grid", "schedule", "v", "m", "bubble_measured", "bubble_pred", "bubble_err_pts",
           "bubble_uniform", "bubble_textbook", "step_ms", "step_pred_ms", "step_err_pct",
           "overhead_us", "latency_us", "jitter_cv", "contention", "ok"]
BUBBLE_PTS, STEP_PCT, CONT_STEP_PCT = 1.5, 10.0, 5.0
# A row is marked when its units ran this much slower beside a neighbour's compute than alone,
# with the line explaining this share of their spread (analysis.contention). Over 193 rows of
# five calibrate runs, three reached 1.22-1.36 (R^2 0.44-0.63) and missed; every other row's
# R^2 was at most 0.16.
CONTENTION_SLOWDOWN, CONTENTION_R2 = 1.1, 0.3


def configurations(quick: bool, continuous: bool = False):
    """(dp, pp, tp, schedule, v, m): bubble.py's pp = 2 rows, then tp = 2 and dp = 2; or the
    continuous rows only (``continuous``)."""
    if continuous:
        for sched in ("pipedream-cont", "pipedream-2bw-cont"):
            for m in (2, 4) if quick else (2, 4, 8):
                yield 1, 2, 1, sched, 1, m
        return
    for pp, sched, v, m in bubble.configurations(quick):
        if pp == 2 and (not quick or m == 4):
            yield 1, pp, 1, sched, v, m
    yield 1, 1, 2, "1f1b", 1, 4
    yield 2, 1, 1, "1f1b", 1, 4


def contended(path) -> float | None:
    """The row's contention slowdown when it is marked (module doc of analysis.contention)."""
    from mpipar.analysis.contention import contention
    from mpipar.analysis.dump import load

    run = load(path)
    c = contention(run, [s for s in run.steps() if s >= 1])
    if c and c["slowdown"] >= CONTENTION_SLOWDOWN and c["r2"] >= CONTENTION_R2:
        return c["slowdown"]
    return None


def row(path, dp, pp, tp, sched, v, m) -> dict:
    from mpipar.analysis import breakdown

    s = breakdown(path)["summary"]
    pred = s.get("predicted") or {}
    model = pred.get("model", {})
    out = {"grid": f"dp{dp} pp{pp} tp{tp}", "schedule": sched, "v": v, "m": m,
           "bubble_measured": s["bubble_pipeline"], "bubble_pred": s.get("bubble_pred"),
           "bubble_uniform": bubble._num(s["bubble_sim"]),
           "bubble_textbook": bubble._num(s["bubble_textbook"]),
           "step_ms": 1e3 * s["step_time"],
           "step_pred_ms": 1e3 * s["step_time_pred"] if "step_time_pred" in s else None,
           "overhead_us": 1e6 * model.get("overhead", float("nan")),
           "latency_us": 1e6 * model.get("latency", float("nan")),
           "jitter_cv": model.get("jitter_cv", float("nan")),
           "contention": contended(path) or "",
           "predict_note": s.get("predict_note", "")}
    if out["bubble_pred"] is not None and out["step_pred_ms"] is not None:
        out["bubble_err_pts"] = 100 * (out["bubble_pred"] - out["bubble_measured"])
        out["step_err_pct"] = 100 * (out["step_pred_ms"] - out["step_ms"]) / out["step_ms"]
        # every row, dp = 2 and tp = 2 too: the prediction simulates each dp replica and tp rank
        step_pct = CONT_STEP_PCT if sched.endswith("-cont") else STEP_PCT
        out["ok"] = (abs(out["step_err_pct"]) <= step_pct
                     and abs(out["bubble_err_pts"]) <= BUBBLE_PTS)
    return out


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--continuous", action="store_true",
                   help="only the continuous rows (PipeDream and 2BW without a flush, m = 2, 4, "
                        "8), each judged on 1.5 points and 5 %% of step")
    args = p.parse_args(argv)
    out = common.out_dir(args, NAME)
    config, base, n_layer = common.bubble_model(args, 3, 6)
    rows = []
    for dp, pp, tp, sched, v, m in configurations(args.quick, args.continuous):
        run_dir = out / f"dp{dp}_pp{pp}_tp{tp}_{sched}_m{m}"
        sets = dict(base)
        kind, cont = bubble.kind_of(sched)  # "-cont": the schedule without a flush
        sets.update({"parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp,
                     "parallel.schedule": kind, "parallel.continuous": cont,
                     "parallel.microbatches": m, "parallel.virtual_stages": v})
        if pp > 1:
            sets["parallel.boundaries"] = common.balanced_boundaries(n_layer, pp * v)
        else:
            sets["parallel.partition"] = "uniform"
        path = common.train(run_dir, dp * pp * tp, config, sets, args)
        rows.append(row(path, dp, pp, tp, sched, v, m))
    ok = sum(1 for r in rows if r.get("ok"))
    marked = [f"{r['schedule']} m={r['m']}" for r in rows if r["contention"]]
    title = (f"calibrated cost model: predicted vs measured ({ok}/{len(rows)} within "
             f"{BUBBLE_PTS} points and {STEP_PCT:.0f} %, continuous rows {CONT_STEP_PCT:.0f} %)")
    if marked:  # the simulator has no term for it: say so beside the table, change nothing
        title += (f"; units ran >= {CONTENTION_SLOWDOWN:.1f}x slower beside a neighbour's "
                  f"compute than alone in {', '.join(marked)} (column contention): the ranks "
                  "contended for the cores, which the model does not simulate; rerun alone")
    common.write_results(out, title, rows, COLUMNS,
                         meta={"config": str(config), "steps": base["train.steps"],
                               "quick": args.quick,
                               "targets": {"bubble_pts": BUBBLE_PTS, "step_pct": STEP_PCT,
                                           "continuous_step_pct": CONT_STEP_PCT},
                               "contention_marks": {"slowdown": CONTENTION_SLOWDOWN,
                                                    "r2": CONTENTION_R2},
                               **common.machine_note()})
    plot(rows, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def plot(rows, path):
    """Predicted against measured, bubble and step, one point per row: the diagonal is a
    perfect prediction, the band the target (1.5 points, 10 %); a missed row is red."""
    plt = common.pyplot()
    rows = [r for r in rows if r.get("bubble_pred") is not None and r.get("step_pred_ms")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    colors = ["tab:blue" if r.get("ok") else "tab:red" for r in rows]
    bm = [100 * r["bubble_measured"] for r in rows]
    ax1.scatter(bm, [100 * r["bubble_pred"] for r in rows], c=colors, s=18)
    top = max(bm + [1.0]) * 1.05
    ax1.plot([0, top], [0, top], "k-", lw=0.8)
    ax1.fill_between([0, top], [-BUBBLE_PTS, top - BUBBLE_PTS], [BUBBLE_PTS, top + BUBBLE_PTS],
                     color="grey", alpha=0.2, label=f"+-{BUBBLE_PTS} points")
    ax1.set_xlabel("measured bubble (%)")
    ax1.set_ylabel("predicted bubble (%)")
    ax1.legend(loc="upper left")
    sm = [r["step_ms"] for r in rows]
    ax2.scatter(sm, [r["step_pred_ms"] for r in rows], c=colors, s=18)
    lo, hi = min(sm) * 0.9, max(sm) * 1.1
    ax2.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax2.fill_between([lo, hi], [lo * (1 - STEP_PCT / 100), hi * (1 - STEP_PCT / 100)],
                     [lo * (1 + STEP_PCT / 100), hi * (1 + STEP_PCT / 100)],
                     color="grey", alpha=0.2, label=f"+-{STEP_PCT:.0f} %")
    ax2.set_xlabel("measured step (ms)")
    ax2.set_ylabel("predicted step (ms)")
    ax2.legend(loc="upper left")
    ok = sum(1 for r in rows if r.get("ok"))
    fig.suptitle(f"calibrated cost model: {ok} of {len(rows)} rows within both targets "
                 "(red: missed)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
