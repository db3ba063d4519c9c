"""PipeDream's compute orders (Harlap et al. 2018; PipeDream-2BW, Narayanan et al. 2021): the
1F1B order per step, and across steps without a flush (``continuous_orders``). The placement of
sends and receives is ``generators``'; which weights each forward uses is ``versions``'.
"""

from __future__ import annotations

from .actions import Action, Schedule, ScheduleError

CONTINUOUS = ("pipedream", "pipedream-2bw")  # schedules that can run without a flush


def one_f_one_b(pp, m, r):
    """PipeDream-Flush (Narayanan et al. 2021): warm-up, one-forward-one-backward, cool-down."""
    warm = min(pp - r - 1, m)
    out = [Action("F", j, r) for j in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i, r), Action("BW", i, r)]
    out += [Action("BW", j, r) for j in range(m - warm, m)]
    return out


def pipedream(pp, m, v):
    """Asynchronous PipeDream (Harlap et al. 2018): the 1F1B order with no flush.

    Right after BW(mb, c) comes UPDATE(mb, c): the optimizer applies that micro-batch's gradient
    to chunk c's weights at once. Weight stashing: F(mb, c) uses the weights current when it runs
    and BW(mb, c) uses those same (stashed) weights, so each micro-batch's gradient is exact for
    the weights its forward saw, but those weights are stale: on rank r, F(mb, c) sees the
    weights after the updates of every earlier BW on that rank, i.e. version
    ``weight_versions(s)[(mb, c)]`` = max(0, mb - (pp - r - 1)) in the steady state (mb counted
    from 0): the first stage runs pp-1 micro-batches behind the last. Different stages thus use
    different versions for one micro-batch (no vertical sync, as in the paper).
    """
    out = []
    for r in range(pp):
        acts = []
        for a in one_f_one_b(pp, m, r):
            acts.append(a)
            if a.op == "BW":
                acts.append(Action("UPDATE", a.mb, a.chunk))
        out.append(acts)
    return out


def continuous_orders(kind: str, pp: int, m: int, steps: int) -> list[list[Action]]:
    """PipeDream (Harlap et al. 2018) or PipeDream-2BW (Narayanan et al. 2021) across ``steps``
    training steps with no flush: the 1F1B order over all ``steps * m`` micro-batches (step k's
    cool-down interleaves with step k+1's warm-up: the warm-up happens once, the drain only at
    the end of the lists), with weight stashing. PipeDream: UPDATE after every backward;
    2BW: after the backward of each step's last micro-batch (one update per step, applied to the
    newest weights while the step's gradient was taken on the older buffer: versions.py)."""
    total = steps * m
    probe = Schedule(kind, pp, 1, m, steps=steps)
    orders = []
    for r in range(pp):
        acts = []
        for a in one_f_one_b(pp, total, r):
            acts.append(a)
            if a.op == "BW" and probe.updates_after(a.mb):
                acts.append(Action("UPDATE", a.mb, a.chunk))
        orders.append(acts)
    return orders


def validate_continuous(kind, pp, microbatches, steps, vertical_sync):
    if kind not in CONTINUOUS:
        raise ScheduleError(f"only {' and '.join(CONTINUOUS)} run without a flush between steps "
                            f"(continuous); {kind!r} drains every step: drop continuous")
    if vertical_sync and kind != "pipedream":
        raise ScheduleError(f"vertical sync is PipeDream's (pipedream); {kind} already runs "
                            f"every stage of a step on one weight version: drop vertical_sync")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ScheduleError(f"steps must be a positive integer, got {steps!r}")
    if kind == "pipedream-2bw" and steps is not None and microbatches < pp - 1:
        raise ScheduleError(
            f"pipedream-2bw without a flush needs microbatches >= pp - 1 = {pp - 1} (got "
            f"{microbatches}): with fewer, the first stage starts step k+2 before step k's "
            f"update and would need a third weight buffer; use microbatches={pp - 1} or more")
