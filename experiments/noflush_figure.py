"""Bubble against micro-batches, flush against no flush: a figure from ``noflush_ab.sh``'s dumps.

usage: python experiments/noflush_figure.py OUT [PNG]   (default PNG: OUT/noflush_bubble.png)

One panel per configuration (tiny GPT, MLP); per schedule (GPipe and 1F1B flush every step,
continuous PipeDream and PipeDream-2BW do not) the measured bubble (``b_calls`` of
``noflush_summary.py``: the pipeline window, a continuous run's over each rank's calls) as a
solid line and its calibrated prediction (the simulation on the costs fitted from that dump) as
a dashed one, the median over rounds at each m. The runs come from

    MS="2 4 8 16" SCHEDS="gpipe 1f1b pipedream-cont pipedream-2bw-cont" ANALYZE=0 \\
      bash experiments/noflush_ab.sh /tmp/noflush_fig 1 30

(32 runs of 30 steps, about 1.5 minutes on 2 idle cores, then about 1.5 minutes of analysis
by ``noflush_summary.py``, whose numbers this script reads back from each run's
``noflush_row.json``). Prints the
plotted numbers as a table too. Needs matplotlib (``pip install mpipar[plots]``).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from noflush_summary import rows  # noqa: E402

STYLE = {"gpipe": ("GPipe (flush)", "#7f7f7f"), "1f1b": ("1F1B (flush)", "#1f77b4"),
         "pipedream-cont": ("PipeDream (no flush)", "#d62728"),
         "pipedream-2bw-cont": ("PipeDream-2BW (no flush)", "#2ca02c")}


def curves(found: list[dict]) -> dict:
    """{cfg: {sched: [(m, measured, predicted)] sorted by m}}, medians over rounds."""
    acc = defaultdict(lambda: ([], []))
    for r in found:
        meas, pred = acc[(r["cfg"], r["sched"], r["m"])]
        meas.append(r["bubble_pipe"])
        pred.append(r["bubble_pred"])
    out = defaultdict(dict)
    for (cfg, sched, m), (meas, pred) in sorted(acc.items()):
        pred = [p for p in pred if not math.isnan(p)]
        out[cfg].setdefault(sched, []).append(
            (m, float(np.median(meas)), float(np.median(pred)) if pred else math.nan))
    return out


def table(cur: dict) -> str:
    lines = [f"{'config':6s} {'schedule':20s} {'m':>3s} {'measured':>9s} {'simulated':>9s}"]
    for cfg, by in cur.items():
        for sched, pts in by.items():
            lines += [f"{cfg:6s} {sched:20s} {m:3d} {100 * a:8.1f}% {100 * b:8.1f}%"
                      for m, a, b in pts]
    return "\n".join(lines)


def draw(cur: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * max(1, len(cur)), 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(cur)), squeeze=False)[0]
    for ax, (cfg, by) in zip(axes, sorted(cur.items())):
        for sched, pts in by.items():
            label, color = STYLE.get(sched, (sched, None))
            ms = [p[0] for p in pts]
            ax.plot(ms, [100 * p[1] for p in pts], "o-", color=color, label=f"{label}, measured")
            ax.plot(ms, [100 * p[2] for p in pts], "x--", color=color, alpha=0.7,
                    label=f"{label}, simulated")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p[0] for pts in by.values() for p in pts}))
        ax.get_xaxis().set_major_formatter("{x:.0f}")
        ax.set_xlabel("micro-batches per step (m), pp = 2")
        ax.set_ylabel("bubble (%)")
        ax.set_title(cfg)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=120)


def main(out: Path, png: Path) -> None:
    cur = curves(rows(out))
    if not cur:
        sys.exit(f"no runs named r<round>_<cfg>_m<m>_<schedule> with a trace.h5 in {out}: run "
                 "noflush_ab.sh into it first (see this script's doc)")
    print(table(cur))
    draw(cur, png)
    print(f"figure: {png}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python experiments/noflush_figure.py OUT [PNG] (OUT: the folder "
                 "noflush_ab.sh wrote)")
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else
         Path(sys.argv[1]) / "noflush_bubble.png")
