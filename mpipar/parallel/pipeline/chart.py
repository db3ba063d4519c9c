"""Draw a simulated schedule: a text timeline (one row per rank) or a matplotlib Gantt PNG."""

from __future__ import annotations

import string

from .actions import Action, Schedule
from .simulate import SimResult

_LETTER = {"F": "F", "B": "B", "W": "W", "BW": "B", "UPDATE": "U"}
_COLOUR = {"F": "#4C78A8", "B": "#54A24B", "BW": "#54A24B", "W": "#F58518", "UPDATE": "#E45756"}


def _label(a: Action, s: Schedule) -> str:
    label = f"{_LETTER[a.op]}{a.mb}"
    if s.virtual_stages > 1:  # which of the rank's chunks: a = first, b = second, ...
        label += string.ascii_lowercase[s.local_chunk(a.chunk) % 26]
    return label


def _compute_spans(result: SimResult):
    for r, row in enumerate(result.timeline):
        for start, end, a in row:
            if a.is_compute and end > start:
                yield r, start, end, a


def text_chart(result: SimResult, s: Schedule, width: int = 120) -> str:
    """One row per rank, one column per time unit (the shortest compute), wrapped to ``width``.

    Each column shows the action running in the middle of that time slot, e.g. ``F3`` or ``B0``
    (a BW taking two units shows in two columns); ``.`` is idle (the bubble).
    """
    spans = list(_compute_spans(result))
    if not spans or result.makespan <= 0:
        return "(empty schedule)\n"
    unit = min(end - start for _, start, end, _ in spans)
    n_cols = int(round(result.makespan / unit + 0.4999))
    grid = [["."] * n_cols for _ in range(s.pp)]
    for r, start, end, a in spans:
        first = int(start / unit + 1e-9)
        for col in range(first, n_cols):
            mid = (col + 0.5) * unit
            if mid >= end:
                break
            if mid >= start:
                grid[r][col] = _label(a, s)
    cell = max(len(c) for row in grid for c in row)
    name = f"rank {s.pp - 1}"
    per_block = max(1, (width - len(name) - 2) // (cell + 1))
    split = any(a.op in ("B", "W") for _, _, _, a in spans)
    legend = [
        f"{s.kind}: pp={s.pp} virtual_stages={s.virtual_stages} microbatches={s.microbatches}; "
        f"one column = {unit:g} time units",
        "F<mb> forward, "
        + ("B<mb> input-grad backward, W<mb> weight-grad backward" if split else "B<mb> backward")
        + (", a/b/.. = the rank's 1st/2nd/.. model chunk" if s.virtual_stages > 1 else "")
        + (f" (placement {s.placement})" if s.placement != "loop" else "")
        + (", an F right before a B of another chunk is a paired F&B" if s.pairs else "")
        + ", . idle",
    ]
    lines = legend
    for lo in range(0, n_cols, per_block):
        hi = min(n_cols, lo + per_block)
        lines.append(f"{'':>{len(name)}}  t = {lo * unit:g}")
        for r in range(s.pp):
            cells = " ".join(f"{c:<{cell}}" for c in grid[r][lo:hi])
            lines.append(f"{f'rank {r}':>{len(name)}}: {cells.rstrip()}")
    return "\n".join(lines) + "\n"


def save_png(result: SimResult, s: Schedule, path) -> None:
    """Gantt chart: one row per rank (rank 0 on top), boxes coloured by op, mb numbers inside."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(result.makespan, 1e-9)
    fig, ax = plt.subplots(figsize=(min(40, 4 + span * 0.35), 0.6 * s.pp + 1.6))
    for r, start, end, a in _compute_spans(result):
        # later chunks of a rank in lighter shades
        shade = 1.0 - 0.35 * s.local_chunk(a.chunk) / max(1, s.virtual_stages - 1)
        ax.barh(r, end - start, left=start, height=0.8, color=_COLOUR[a.op], alpha=shade,
                edgecolor="black", linewidth=0.5)
        ax.text((start + end) / 2, r, _label(a, s)[1:], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (cost units)")
    ax.set_title(
        f"{s.kind}  pp={s.pp} v={s.virtual_stages} m={s.microbatches}   "
        f"bubble {result.bubble_fraction:.3f}   peak activations {max(result.peak_activations)}"
    )
    used = sorted({a.op for _, _, _, a in _compute_spans(result)}, key=list(_COLOUR).index)
    ax.legend(handles=[Patch(color=_COLOUR[o], label=o) for o in used],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
