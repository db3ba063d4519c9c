"""Lowering: a checked schedule turned into the order the executor runs.

The generators place each send and receive so that the schedule cannot deadlock even if every
send blocks until its receive is posted (rendezvous; ``check_schedule`` replays that). The
executor's sends are non-blocking and its receives are posted ahead, which allows a better
order: ``sends_first``. Lowering is applied once, where a run's schedule is made
(``build.run_schedule``) and where ``mpipar schedule`` draws one, so the checker, the simulator,
the charts, the calibrated predictions and the executor all see the same order.
"""

from __future__ import annotations

from dataclasses import replace

from .actions import Action, Schedule

_COMM_OPS = frozenset(("SEND_F", "SEND_B", "RECV_F", "RECV_B"))


def sends_first(actions: list[Action]) -> list[Action]:
    """One rank's actions with, in every run of sends and receives between two computes, the
    sends first (stable). A send there carries data an earlier compute made, and sends are
    non-blocking with receives posted ahead, so this cannot deadlock; it stops a rank from
    waiting for its next input before handing a peer the output that peer waits for (the last
    1F1B stage waited for F(mb+1)'s activation before sending B(mb)'s gradient, which held the
    previous stage up once per micro-batch). The schedule's data is unchanged, and so is every
    compute's index in the list (DualPipe's ``pairs`` stay valid); only the order in which the
    rank posts its messages moves."""
    out, run = [], []
    for a in actions + [None]:
        if a is not None and a.op in _COMM_OPS:
            run.append(a)
            continue
        out += [x for x in run if x.op.startswith("SEND")]
        out += [x for x in run if x.op.startswith("RECV")]
        run = []
        if a is not None:
            out.append(a)
    return out


def lower(s: Schedule) -> Schedule:
    """The schedule in the executor's order (``sends_first`` on every rank), marked
    ``lowered``; a lowered schedule comes back as it is."""
    if s.lowered:
        return s
    return replace(s, ranks=[sends_first(acts) for acts in s.ranks], pairs=list(s.pairs),
                   lowered=True)
