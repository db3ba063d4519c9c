"""Figures of timing dumps: a per-rank Gantt chart of one step, per-rank time bars, scaling.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no global
state, no display needed) and written as PNG or SVG by the path's suffix. Each function returns
the Figure, so tests and notebooks can look inside it.
"""

from __future__ import annotations

import os

import numpy as np

from .breakdown import COMPUTE_KINDS, breakdown, select_steps
from .dump import Run, load

# one colour per action; communication by axis (tab10 / tab20 picks, readable in print)
COLORS = {
    "F": "#1f77b4",
    "B": "#2ca02c",
    "W": "#bcbd22",
    "R": "#9467bd",
    "LOSS": "#d62728",
    "OPT": "#7f7f7f",
    "pp": "#ff7f0e",
    "tp": "#17becf",
    "dp": "#e377c2",
    "world": "#8c564b",
    "other": "#000000",
    "exposed": "#ff7f0e",
    "idle": "#ffffff",
}
COMM_LABELS = {"pp": "pp p2p", "tp": "tp collective", "dp": "dp sync", "world": "world"}


def _figure(width, height):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path) -> None:
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg"):
        raise ValueError(f"plot file {path}: use a .png or .svg suffix")
    check_plot_dir(os.path.dirname(os.path.abspath(path)))
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ValueError(f"cannot write the plot {path}: {exc.strerror or exc}; pass a "
                         f"writable directory (--plots DIR)") from None


def check_plot_dir(directory) -> None:
    """Create ``directory`` if needed and probe that files can be written there; ``ValueError``
    naming it otherwise (permission bits lie for root and on some network file systems)."""
    import tempfile

    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mpipar-probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write plots into {directory}: {exc.strerror or exc}; pass a "
                         f"writable directory (--plots DIR)") from None


def _as_run(run) -> Run:
    return run if isinstance(run, Run) else load(run)


def _group(kind: str) -> str:
    """Colour group of an event kind: the compute kind itself, or the communication axis."""
    if kind in COLORS and "." not in kind:
        return kind
    axis = kind.split(".", 1)[0]
    return axis if "." in kind and axis in COMM_LABELS else "other"


def timeline(run, path, step: int | None = None):
    """Gantt chart of one step (default: the first measured one), one row per rank.

    Compute boxes fill the row, labelled with their micro-batch; communication is drawn as a
    thinner band along the bottom of the row, so a send that overlaps compute stays visible.
    """
    run = _as_run(run)
    if step is None:
        step = select_steps(run)[0][0]
    else:
        select_steps(run, step)  # clear error for a step that is not there
    world = run.world_size
    evs = [e[(e["step"] == step) & (e["kind"] != "STEP")] for e in run.events]
    markers = [e[(e["step"] == step) & (e["kind"] == "STEP")] for e in run.events]
    starts = [m["start"].min() for m in markers if m.size] or [
        e["start"].min() for e in evs if e.size
    ]
    t0 = float(min(starts))
    ends = [m["end"].max() for m in markers if m.size] + [e["end"].max() for e in evs if e.size]
    span = max(float(max(ends)) - t0, 1e-12)

    fig = _figure(11, 1.0 + 0.45 * world)
    ax = fig.add_subplot()
    present = set()
    for r in range(world):
        e = evs[r]
        groups = np.array([_group(k) for k in e["kind"]], dtype=object)
        for g in np.unique(groups) if e.size else []:
            m = groups == g
            comm = g in COMM_LABELS or g == "other"
            y, h = (r + 0.1, 0.3) if comm else (r - 0.4, 0.8)
            bars = list(
                zip(
                    (e["start"][m] - t0).tolist(),
                    (e["end"][m] - e["start"][m]).tolist(),
                    strict=True,
                )
            )
            ax.broken_barh(
                bars,
                (y, h),
                facecolors=COLORS[g],
                edgecolors="black",
                linewidth=0.3,
                alpha=0.85 if comm else 1.0,
            )
            present.add(g)
            if not comm:
                for s, d, mb in zip(
                    e["start"][m] - t0, e["end"][m] - e["start"][m], e["mb"][m], strict=True
                ):
                    if mb >= 0 and d > 0.015 * span:  # label only boxes wide enough to read
                        ax.text(
                            s + d / 2,
                            r - 0.1,
                            str(int(mb)),
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="white",
                        )
    ax.set_yticks(range(world))
    ax.set_yticklabels([run.label(r) for r in range(world)])
    ax.set_ylim(world - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds since the step started")
    ax.set_title(f"{run.name}: step {step} (numbers: micro-batch)")
    from matplotlib.patches import Patch

    order = [g for g in COLORS if g in present]
    ax.legend(
        handles=[
            Patch(facecolor=COLORS[g], edgecolor="black", label=COMM_LABELS.get(g, g))
            for g in order
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    _save(fig, path)
    return fig


def breakdown_bars(run, path, step: int | None = None):
    """Stacked per-rank bars, seconds per step: self time of compute kinds, communication, idle."""
    result = run if isinstance(run, dict) and "ranks" in run else breakdown(_as_run(run), step=step)
    run_obj = None if isinstance(run, dict) else _as_run(run)
    t = result["ranks"]
    world = len(t["rank"])
    labels = [run_obj.label(r) if run_obj else f"r{r}" for r in range(world)]
    fig = _figure(9, 1.0 + 0.4 * world)
    ax = fig.add_subplot()
    left = np.zeros(world)
    # self times: each instant once, so a bar's segments add up to the rank's step time
    parts = [(f"self_{k}", k, k) for k in COMPUTE_KINDS]
    parts += [(f"self_{a}", a, COMM_LABELS[a]) for a in COMM_LABELS]
    parts += [("self_other", "other", "other"), ("idle", "idle", "idle")]
    for key, colour, label in parts:
        vals = np.nan_to_num(t[key])
        if not vals.any():
            continue
        hatch = "//" if key == "idle" else None
        ax.barh(
            range(world),
            vals,
            left=left,
            color=COLORS[colour],
            edgecolor="black",
            linewidth=0.4,
            hatch=hatch,
            label=label,
        )
        left += vals
    ax.set_yticks(range(world))
    ax.set_yticklabels(labels)
    ax.set_ylim(world - 0.5, -0.5)
    ax.set_xlabel("seconds per step")
    steps = result["steps"]
    ax.set_title(f"{result['run']}: time per step by rank (steps {steps[0]}-{steps[-1]})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    _save(fig, path)
    return fig


SCALING_X = {"ranks": "world_size", "dp": "dp", "pp": "pp", "tp": "tp"}


def scaling(runs, path, x: str = "ranks"):
    """Tokens/s and scaling efficiency against world size (or one axis) across runs.

    Efficiency of a point = (tokens/s per unit of x) / (the same at the smallest x of its line);
    one line per schedule. ``runs``: Runs, paths or breakdown dicts.
    """
    if x not in SCALING_X:
        raise ValueError(f"x must be one of {sorted(SCALING_X)}, got {x!r}")
    results = [r if isinstance(r, dict) and "summary" in r else breakdown(_as_run(r)) for r in runs]
    if not results:
        raise ValueError("scaling needs at least one run")
    lines: dict[str, list] = {}
    for res in results:
        s = res["summary"]
        lines.setdefault(str(s.get("schedule")), []).append(
            (float(s[SCALING_X[x]]), s["tokens_per_s"])
        )
    fig = _figure(10, 4)
    ax_t, ax_e = fig.subplots(1, 2)
    for name, pts in sorted(lines.items()):
        pts.sort()
        xs = np.array([p[0] for p in pts])
        tps = np.array([p[1] for p in pts], dtype=float)
        ax_t.plot(xs, tps, marker="o", label=name)
        eff = (tps / xs) / (tps[0] / xs[0])
        ax_e.plot(xs, eff, marker="o", label=name)
    xlabel = "world size (ranks)" if x == "ranks" else f"{x} size"
    ticks = sorted({p[0] for pts in lines.values() for p in pts})
    for ax in (ax_t, ax_e):
        ax.set_xlabel(xlabel)
        if ticks[0] > 0 and ticks[-1] / ticks[0] >= 4:
            ax.set_xscale("log", base=2)  # sweeps double the ranks: even spacing
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("tokens/s")
    ax_e.set_ylabel("efficiency (per-rank tokens/s vs the smallest run)")
    ax_e.axhline(1.0, color="grey", linewidth=0.8)
    ax_t.legend(title="schedule", fontsize=8)
    _save(fig, path)
    return fig
