"""Which weight version each forward of an asynchronous schedule runs with (data, no MPI).

A chunk's version k is its weights after k UPDATEs on its rank within the schedule's lists
(version 0: the weights when the lists start). The executor stashes the version F(mb, c) ran
with for BW(mb, c), and a one-rank replay applies the same versions, so both follow this map:

- ``pipedream``: the weights current when F runs (the number of UPDATEs of the chunk before it
  on its rank); with vertical sync (``Schedule.vertical_sync``) every chunk uses the version the
  first chunk used for that micro-batch, an older one the rank kept (PipeDream's vertical sync);
- ``pipedream-2bw``: micro-batches of step k run with the weights before step k-1's update,
  ``W(k-1)``: version ``k - 1``. Version -1 is the older of the two buffers carried into the
  lists (``W(-1) = W(0)`` when training starts), so ``W(k+1) = W(k) - lr grad(W(k-1))``.
"""

from __future__ import annotations

from .actions import Schedule, ScheduleError


def weight_versions(s: Schedule) -> dict[tuple[int, int], int]:
    """(mb, chunk) -> the weight version F(mb, chunk) runs with (all 0 when synchronous)."""
    versions = updates_before(s)  # PipeDream: the newest version when the forward runs
    if s.asynchronous and s.kind == "pipedream-2bw":
        return {key: s.step_of(key[0]) - 1 for key in versions}
    if s.asynchronous and s.vertical_sync:
        return {(mb, c): versions[(mb, 0)] for (mb, c) in versions}
    return versions


def updates_before(s: Schedule) -> dict[tuple[int, int], int]:
    """(mb, chunk) -> UPDATEs of the chunk on its rank before F(mb, chunk): the newest version
    that exists when the forward runs."""
    out: dict[tuple[int, int], int] = {}
    for acts in s.ranks:
        done: dict[int, int] = {}
        for a in acts:
            if a.op == "UPDATE":
                done[a.chunk] = done.get(a.chunk, 0) + 1
            elif a.op == "F":
                out[(a.mb, a.chunk)] = done.get(a.chunk, 0)
    return out


def check_versions(s: Schedule) -> None:
    """Every forward's version exists when it runs: made by an UPDATE before it (a rank keeps
    older versions, never future ones), or the older buffer carried in (2BW: version -1)."""
    oldest = -1 if s.kind == "pipedream-2bw" else 0
    have = updates_before(s)
    for (mb, c), v in sorted(weight_versions(s).items()):
        if v > have[(mb, c)] or v < oldest:
            raise ScheduleError(
                f"F{mb}.{c} (rank {s.rank_of(c)}) must run with weight version {v}, but only "
                f"versions {oldest}..{have[(mb, c)]} exist when it runs: move the UPDATEs "
                f"of chunk {c} before it, or use more micro-batches per step")
