"""Experiment 1: pipeline bubble fraction against micro-batches, for every schedule.

For pp = 2 and 4 and m in 1, 2, 4, 8 it trains a few steps of the GPT in
experiments/configs/exp_bubble.toml with each schedule (naive, GPipe, 1F1B, interleaved with 2
virtual stages, ZB-H1) and compares three numbers:

- measured: ``bubble_pipeline`` of ``mpipar.analysis.breakdown`` (1 - model compute / the
  pipeline window shared by all ranks, mean over ranks and measured steps);
- simulated: the schedule simulator fed with that run's measured F, B, W and p2p costs
  (``bubble_sim``: one mean cost per kind; ``bubble_pred``: the calibrated per-rank, per-chunk
  cost model with overheads, ``mpipar.analysis.costmodel``);
- textbook: the closed formula ((p-1)/(m+p-1) for GPipe and 1F1B, ...).

The 2023-2025 schedules (ZB-H2, ZB-V, looped BFS, V-Half, V-Min, DualPipeV) and PipeDream-2BW /
PipeDream without a flush (``pipedream-2bw``; ``pipedream-cont``, ``pipedream-2bw-cont``:
``parallel.continuous``) are
measured at pp = 2 only; their rows at pp = 4 and 8 (``source`` = ``sim``) are the simulator fed
with the per-stage costs measured at pp = 2 (scaled by 2 / pp: the same model cut in pp stages;
p2p unchanged). A continuous schedule is simulated over SIM_STEPS steps: its bubble is that of
the whole run, the warm-up and drain paid once.

Run: ``python experiments/bubble.py [--quick] [--out DIR]`` (it starts mpiexec itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "bubble"
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
# measured at pp = 2, simulated at SIM_PPS with those costs; "-cont": parallel.continuous
NEW_SCHEDULES = ("zb-h2", "zb-v", "looped-bfs", "v-half", "v-min", "dualpipev",
                 "pipedream-2bw", "pipedream-cont", "pipedream-2bw-cont")
SIM_PPS = (4, 8)
SIM_STEPS = 4  # steps a continuous schedule is simulated over
COLUMNS = ["pp", "schedule", "v", "m", "source", "bubble_measured", "bubble_step", "bubble_sim",
           "bubble_pred", "bubble_textbook", "step_ms", "step_pred_ms", "F_ms", "B_ms", "W_ms",
           "comm_ms"]


def kind_of(sched: str) -> tuple[str, bool]:
    """(schedule kind, continuous) of a row label."""
    return (sched[:-5], True) if sched.endswith("-cont") else (sched, False)


def valid(sched: str, pp: int, m: int) -> tuple[bool, int]:
    """(whether (pp, m) suits the schedule, its virtual stages)."""
    from mpipar.parallel.pipeline.generators import build_schedule, default_virtual_stages

    kind, cont = kind_of(sched)
    v = default_virtual_stages(kind)
    try:
        build_schedule(kind, pp, m, v, steps=SIM_STEPS if cont else None)
    except ValueError:
        return False, v
    return True, v


def configurations(quick: bool):
    """(pp, schedule, virtual, m) to run; invalid combinations are left out, not errors."""
    pps = (2,) if quick else (2, 4)
    ms = (1, 4) if quick else (1, 2, 4, 8)
    scheds = ("gpipe", "1f1b", "zb-h1") if quick else SCHEDULES
    for pp in pps:
        for s in scheds:
            for m in ms:
                v = 2 if s == "interleaved" else 1
                if s == "naive" and m != 1:
                    continue  # naive = one micro-batch through the stages
                if s == "interleaved" and m % pp:
                    continue  # the interleaved schedule needs m to be a multiple of pp
                yield pp, s, v, m
    for s in NEW_SCHEDULES[-3:] if quick else NEW_SCHEDULES:  # measured at pp = 2 only
        for m in ms:
            ok, v = valid(s, 2, m)
            if ok:
                yield 2, s, v, m


def simulated(sched: str, pp: int, m: int, v: int, costs: dict) -> float:
    """The bubble of ``sched`` at pp, m with per-chunk costs measured at pp = 2 (module doc)."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.simulate import simulate

    kind, cont = kind_of(sched)
    stage = {k: (c * v * 2 / pp if k != "comm" else c) for k, c in costs.items()}
    s = build_schedule(kind, pp, m, v, steps=SIM_STEPS if cont else None)
    return float(simulate(s, stage).bubble_fraction)


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    config, base, n_layer = common.bubble_model(args, 2, 4)

    from mpipar.analysis import breakdown

    rows = []
    for pp, sched, v, m in configurations(args.quick):
        run_dir = out / f"pp{pp}_{sched}_m{m}"
        sets = dict(base)
        kind, cont = kind_of(sched)
        sets.update({"parallel.pp": pp, "parallel.schedule": kind, "parallel.microbatches": m,
                     "parallel.virtual_stages": v, "parallel.continuous": cont,
                     "parallel.boundaries": common.balanced_boundaries(n_layer, pp * v)})
        path = common.train(run_dir, pp, config, sets, args)
        s = breakdown(path)["summary"]
        costs = s["costs"]
        if sched in NEW_SCHEDULES:
            s["bubble_sim"] = simulated(sched, pp, m, v, costs)
        rows.append({
            "pp": pp, "schedule": sched, "v": v, "m": m, "source": "measured",
            "bubble_measured": s["bubble_pipeline"], "bubble_step": s["bubble"],
            "bubble_sim": _num(s["bubble_sim"]), "bubble_textbook": _num(s["bubble_textbook"]),
            # the calibrated cost model (per rank and chunk, overheads; see calibrate.py)
            "bubble_pred": _num(s.get("bubble_pred")),
            "step_ms": 1e3 * s["step_time"],
            "step_pred_ms": 1e3 * s["step_time_pred"] if "step_time_pred" in s else None,
            # per chunk; the simulator takes per-stage costs (x v), breakdown does that itself
            "F_ms": 1e3 * costs["F"], "B_ms": 1e3 * costs["B"], "W_ms": 1e3 * costs["W"],
            "comm_ms": 1e3 * costs["comm"],
            "sim_peak_activations": s["sim_peak_activations"],
        })
        if sched in NEW_SCHEDULES:
            rows += _simulated_rows(sched, m, costs)
    common.write_results(out, "bubble fraction (measured = pipeline window; step = whole step)",
                         rows, COLUMNS, meta={"config": str(config), "steps": base["train.steps"],
                                              "quick": args.quick, **common.machine_note()})
    plot(rows, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def _simulated_rows(sched, m, costs):
    """Rows at SIM_PPS from the costs measured at pp = 2 (where (pp, m) suits the schedule)."""
    rows = []
    for pp in SIM_PPS:
        ok, v = valid(sched, pp, m)
        if ok:
            rows.append({"pp": pp, "schedule": sched, "v": v, "m": m, "source": "sim",
                         "bubble_sim": simulated(sched, pp, m, v, costs)})
    return rows


def _num(v):
    return v if isinstance(v, (int, float)) else None


def plot(rows, path):
    plt = common.pyplot()
    pps = sorted({r["pp"] for r in rows})
    fig, axes = plt.subplots(1, len(pps), figsize=(6 * len(pps), 4.5), squeeze=False)
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    colors = {s: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(names)}
    for ax, pp in zip(axes[0], pps, strict=True):
        for sched in names:
            pts = sorted(((r["m"], r) for r in rows if r["pp"] == pp and r["schedule"] == sched),
                         key=lambda t: t[0])
            if not pts:
                continue
            c = colors[sched]
            meas = [(m, p) for m, p in pts if p.get("source") == "measured"]
            if meas:  # rows with source "sim" (pp 4 and 8 of the new schedules) have no run
                ax.plot([t[0] for t in meas], [t[1]["bubble_measured"] for t in meas],
                        marker="s" if len(meas) == 1 else "o", color=c,
                        label=f"{sched} measured")
            ax.plot([t[0] for t in pts], [t[1]["bubble_sim"] for t in pts], linestyle="--",
                    marker="x", color=c, alpha=0.8, label=f"{sched} simulated")
            tb = [(m, p["bubble_textbook"]) for m, p in pts
                  if p.get("bubble_textbook") is not None]
            if tb:
                ax.plot([t[0] for t in tb], [t[1] for t in tb], linestyle=":", color=c,
                        alpha=0.8, label=f"{sched} textbook")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.set_ylim(0, 1)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"pp = {pp}: measured (solid), simulated (--), textbook (:)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
