"""Validate a pipeline schedule before anything runs it.

``check_schedule`` raises ScheduleError naming the offending action as ``rank R, action I (OP)``:
every compute present exactly once on the rank that holds its chunk; local dependencies in
order; every send matched by exactly one receive on the right rank; and no deadlock when each
send blocks until its receive is posted (rendezvous). The executor's non-blocking sends and
early receives can only do better than that, so a schedule that passes here cannot hang.

A lowered schedule (``lowering.lower``: sends moved ahead of receives) is the executor's own
order and relies on its non-blocking sends; its deadlock check replays eager sends instead (a
send never waits; a receive waits for its send), which is exactly what the executor can hang on.
"""

from __future__ import annotations

from .actions import (
    Action,
    Schedule,
    ScheduleError,
    check_placement,
    matching,
    recvs_before,
    sends_after,
)
from .replay import Replay
from .versions import check_versions


def _where(r: int, i: int, a: Action) -> str:
    return f"rank {r}, action {i} ({a})"


def check_schedule(s: Schedule) -> None:
    if s.pp < 1 or s.virtual_stages < 1 or s.microbatches < 1 or s.steps < 1:
        raise ScheduleError(
            f"pp, virtual_stages, microbatches and steps must be >= 1 (got {s.pp}, "
            f"{s.virtual_stages}, {s.microbatches}, {s.steps})"
        )
    if s.vertical_sync and not s.asynchronous:
        raise ScheduleError("vsync=true (vertical sync) needs an asynchronous schedule: set "
                            "asynchronous=true or drop vsync")
    if len(s.ranks) != s.pp:
        raise ScheduleError(f"schedule has pp={s.pp} but {len(s.ranks)} rank lists")
    check_placement(s.placement, s.virtual_stages)
    index = _check_actions(s)
    _check_pairs(s)
    _check_counts(s, index)
    _check_local_order(s, index)
    _check_deadlock(s)
    if s.asynchronous:
        check_versions(s)


def _check_actions(s: Schedule) -> dict[Action, tuple[int, int]]:
    """Ranges, placement and duplicates; returns action -> (rank, index)."""
    n, m = s.n_chunks, s.total_microbatches
    index: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(s.ranks):
        for i, a in enumerate(acts):
            where = _where(r, i, a)
            if a.mb >= m:
                raise ScheduleError(f"{where}: micro-batch {a.mb} out of range 0..{m - 1}")
            if a.chunk >= n:
                raise ScheduleError(
                    f"{where}: chunk {a.chunk} out of range 0..{n - 1} "
                    f"(pp={s.pp} x virtual_stages={s.virtual_stages})"
                )
            if s.rank_of(a.chunk) != r:
                raise ScheduleError(
                    f"{where}: wrong rank: chunk {a.chunk} lives on rank {s.rank_of(a.chunk)} "
                    f"(placement {s.placement})"
                )
            if a.is_comm:
                if (a.op in ("SEND_F", "RECV_B") and a.chunk == n - 1) or (
                    a.op in ("RECV_F", "SEND_B") and a.chunk == 0
                ):
                    raise ScheduleError(f"{where}: chunk {a.chunk} has no neighbour that way")
                peer = matching(a).chunk
                if s.rank_of(peer) == r:
                    raise ScheduleError(
                        f"{where}: chunks {a.chunk} and {peer} are both on rank {r} (placement "
                        f"{s.placement}, pp={s.pp}); they pass data in memory: remove {a}"
                    )
            if a.op == "UPDATE" and not (s.asynchronous and s.updates_after(a.mb)):
                raise ScheduleError(
                    f"{where}: UPDATE is only allowed in asynchronous (PipeDream) schedules, "
                    "after each micro-batch (pipedream) or each step's last one (pipedream-2bw); "
                    "set asynchronous=true in the header or remove it"
                )
            if a in index:
                r0, i0 = index[a]
                raise ScheduleError(f"{where}: duplicate of {_where(r0, i0, a)}")
            index[a] = (r, i)
    return index


def _check_pairs(s: Schedule) -> None:
    """A paired action is an F followed by a backward (B or BW) of another micro-batch."""
    for r, i in s.pairs:
        acts = s.ranks[r] if 0 <= r < s.pp else []
        if i + 1 >= len(acts):
            raise ScheduleError(f"paired action at rank {r}, action {i}: no such action")
        f, b = acts[i], acts[i + 1]
        if f.op != "F" or b.op not in ("B", "BW") or f.mb == b.mb:
            raise ScheduleError(
                f"{_where(r, i, f)}: a paired action is F&B of two different micro-batches, "
                f"got {f}&{b}"
            )


def _check_counts(s: Schedule, index: dict) -> None:
    """Every (mb, chunk) has F and either BW or B+W; sends and receives as needed; UPDATEs."""
    n = s.n_chunks
    for mb in range(s.total_microbatches):
        for c in range(n):
            r = s.rank_of(c)
            need = [Action("F", mb, c)]
            has_bw = Action("BW", mb, c) in index
            has_split = Action("B", mb, c) in index or Action("W", mb, c) in index
            if has_bw and has_split:
                (r0, i0) = index[Action("BW", mb, c)]
                raise ScheduleError(
                    f"{_where(r0, i0, Action('BW', mb, c))}: micro-batch {mb} chunk {c} has "
                    "both BW and a split B/W backward; use one or the other"
                )
            back = [Action("BW", mb, c)] if has_bw else [Action("B", mb, c), Action("W", mb, c)]
            need += back
            if s.asynchronous and s.updates_after(mb):
                need.append(Action("UPDATE", mb, c))
            for a in [need[0], back[0]]:
                need += recvs_before(a, n, s.rank_of) + sends_after(a, n, s.rank_of)
            for a in need:
                if a not in index:
                    raise ScheduleError(
                        f"rank {r}: missing {a} (micro-batch {mb}, chunk {c}); "
                        f"every micro-batch needs {' '.join(str(x) for x in need)} on rank {r}"
                    )
    # Anything left over (e.g. an UPDATE in a flush schedule) was rejected in _check_actions;
    # every comm action present has its partner in `need` of the partner chunk, checked above.
    for a, (r, i) in index.items():
        if a.is_comm and matching(a) not in index:
            raise ScheduleError(f"{_where(r, i, a)}: no matching {matching(a)}")


def _check_local_order(s: Schedule, index: dict) -> None:
    """Dependencies between actions on the same rank (cross-rank ones go through the sends)."""
    n = s.n_chunks
    for r, acts in enumerate(s.ranks):
        for i, a in enumerate(acts):
            before: list[Action] = recvs_before(a, n, s.rank_of)
            # a neighbouring chunk on this rank hands its result over in memory
            if a.op == "F" and a.chunk > 0 and s.rank_of(a.chunk - 1) == r:
                before.append(Action("F", a.mb, a.chunk - 1))
            elif a.op in ("B", "BW"):
                before.append(Action("F", a.mb, a.chunk))
                if a.chunk < n - 1 and s.rank_of(a.chunk + 1) == r:
                    nxt = "BW" if Action("BW", a.mb, a.chunk + 1) in index else "B"
                    before.append(Action(nxt, a.mb, a.chunk + 1))
            if a.op == "W":
                before.append(Action("B", a.mb, a.chunk))
            elif a.op == "UPDATE":
                kind = "BW" if Action("BW", a.mb, a.chunk) in index else "W"
                before.append(Action(kind, a.mb, a.chunk))
            elif a.op == "SEND_F":
                before.append(Action("F", a.mb, a.chunk))
            elif a.op == "SEND_B":
                kind = "BW" if Action("BW", a.mb, a.chunk) in index else "B"
                before.append(Action(kind, a.mb, a.chunk))
            for b in before:
                rb, ib = index[b]
                if ib > i:
                    raise ScheduleError(
                        f"{_where(r, i, a)} comes before {_where(rb, ib, b)}, which it needs; "
                        f"move {a} after {b}"
                    )


class _Rendezvous(Replay):
    """Blocking sends: a send and its receive run together, when both ranks are at them."""

    def __init__(self, s: Schedule):
        super().__init__(s.ranks)
        self.schedule = s

    def can_run(self, r: int, a: Action) -> bool:
        if a.is_compute:
            return True
        peer = matching(a)
        return self.current(self.schedule.rank_of(peer.chunk)) == peer

    def run(self, r: int, a: Action) -> None:
        if a.is_comm:  # the partner completes at the same instant
            self.pos[self.schedule.rank_of(matching(a).chunk)] += 1

    def stuck(self) -> Exception:
        return ScheduleError(_deadlock_message(self.schedule, self.pos))


class _Eager(Replay):
    """Non-blocking sends (the executor's): a receive runs once its send has."""

    def __init__(self, s: Schedule):
        super().__init__(s.ranks)
        self.schedule, self.sent = s, set()

    def can_run(self, r: int, a: Action) -> bool:
        return not a.op.startswith("RECV") or matching(a) in self.sent

    def run(self, r: int, a: Action) -> None:
        if a.op.startswith("SEND"):
            self.sent.add(a)

    def stuck(self) -> Exception:
        return ScheduleError(_deadlock_message(self.schedule, self.pos))


def _check_deadlock(s: Schedule) -> None:
    """Run all ranks with blocking sends (a send and its receive complete together), or, for
    a lowered schedule, with the executor's non-blocking ones."""
    (_Eager if s.lowered else _Rendezvous)(s).play()


def _deadlock_message(s: Schedule, pos: list[int]) -> str:
    acts = s.ranks
    waits = {}
    lines = []
    for r in range(s.pp):
        if pos[r] >= len(acts[r]):
            lines.append(f"rank {r} finished")
            continue
        a = acts[r][pos[r]]
        peer = matching(a)
        q = s.rank_of(peer.chunk)
        at = f"{acts[q][pos[q]]}" if pos[q] < len(acts[q]) else "the end"
        waits[r] = q
        lines.append(f"{_where(r, pos[r], a)} waits for rank {q} to reach {peer} (it is at {at})")
    # Follow the wait-for edges from the first blocked rank to name the cycle.
    cycle, r = [], min(waits)
    while r in waits and r not in cycle:
        cycle.append(r)
        r = waits[r]
    if r in cycle:
        ring = cycle[cycle.index(r):]
        head = "deadlock: cycle " + " -> ".join(f"rank {x} at {acts[x][pos[x]]}" for x in ring)
        head += f" -> rank {ring[0]}"
    else:
        head = "deadlock: no rank can progress"
    return head + "\n  " + "\n  ".join(lines)
