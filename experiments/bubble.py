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

Run: ``python experiments/bubble.py [--quick] [--out DIR]`` (it starts mpiexec itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "bubble"
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
COLUMNS = ["pp", "schedule", "v", "m", "bubble_measured", "bubble_step", "bubble_sim",
           "bubble_pred", "bubble_textbook", "step_ms", "step_pred_ms", "F_ms", "B_ms", "W_ms",
           "comm_ms"]


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


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    config, base, n_layer = common.bubble_model(args, 2, 4)

    from mpipar.analysis import breakdown

    rows = []
    for pp, sched, v, m in configurations(args.quick):
        run_dir = out / f"pp{pp}_{sched}_m{m}"
        sets = dict(base)
        sets.update({"parallel.pp": pp, "parallel.schedule": sched, "parallel.microbatches": m,
                     "parallel.virtual_stages": v,
                     "parallel.boundaries": common.balanced_boundaries(n_layer, pp * v)})
        path = common.train(run_dir, pp, config, sets, args)
        s = breakdown(path)["summary"]
        costs = s["costs"]
        rows.append({
            "pp": pp, "schedule": sched, "v": v, "m": m,
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
    common.write_results(out, "bubble fraction (measured = pipeline window; step = whole step)",
                         rows, COLUMNS, meta={"config": str(config), "steps": base["train.steps"],
                                              "quick": args.quick, **common.machine_note()})
    plot(rows, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def _num(v):
    return v if isinstance(v, (int, float)) else None


def plot(rows, path):
    plt = common.pyplot()
    pps = sorted({r["pp"] for r in rows})
    fig, axes = plt.subplots(1, len(pps), figsize=(6 * len(pps), 4.5), squeeze=False)
    colors = dict(zip(SCHEDULES, ("tab:grey", "tab:blue", "tab:orange", "tab:green", "tab:red"),
                      strict=True))
    for ax, pp in zip(axes[0], pps, strict=True):
        for sched in SCHEDULES:
            pts = sorted((r["m"], r) for r in rows if r["pp"] == pp and r["schedule"] == sched)
            if not pts:
                continue
            ms = [p[0] for p in pts]
            c = colors[sched]
            marker = "s" if len(ms) == 1 else "o"
            ax.plot(ms, [p[1]["bubble_measured"] for p in pts], marker=marker, color=c,
                    label=f"{sched} measured")
            ax.plot(ms, [p[1]["bubble_sim"] for p in pts], linestyle="--", marker="x",
                    color=c, alpha=0.8, label=f"{sched} simulated")
            tb = [(m, p["bubble_textbook"]) for m, p in pts if p["bubble_textbook"] is not None]
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
