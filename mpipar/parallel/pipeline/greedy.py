"""Zero-bubble style compute orders found by a unit-time list scheduler (no MPI here).

ZB-H2, V-Half and V-Min (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.2 and
6; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory") are all the same recipe: split
the backward into B (input gradient, on the critical path) and W (weight gradient, free to move),
bound how many micro-batches may hold activations on each rank, and let every rank run, at each
moment, the most urgent action it can. The papers tune their schedules with a heuristic search of
that kind; here one deterministic pass plays it with F = B = W = one time slot per chunk:

1. a B whose output gradient has arrived (it unblocks the ranks before it);
2. otherwise an F whose input has arrived, if the memory limit allows (later chunk first: it
   brings the loss, and thus the B's, sooner);
3. otherwise the oldest deferred W (it frees that micro-batch's activations);
4. otherwise wait.

Memory is counted in chunk activations, held from F to W. With the V placement a micro-batch that
enters a rank's first chunk will need room for the rank's second chunk too, so admission to the
first chunk reserves both (``_Rank.can_forward``): the limit can then never deadlock the pipeline.
Micro-batches go through each chunk in order (F, B and W alike), as in every schedule here.
"""

from __future__ import annotations

from collections import deque

from .actions import Action, ScheduleError, rank_of_chunk


class _Rank:
    """One rank's chunks, its memory use against ``cap`` and its deferred W's."""

    def __init__(self, chunks: list[int], cap: int):
        self.chunks, self.cap = chunks, cap
        self.live = 0  # chunk activations held (F done, W not yet)
        self.reserved = 0  # micro-batches past this rank's first chunk, not yet at its second
        self.pending_w: deque[Action] = deque()
        self.order: list[Action] = []

    def can_forward(self, c: int) -> bool:
        if len(self.chunks) == 2 and c == self.chunks[0]:
            return self.live + self.reserved + 2 <= self.cap
        if len(self.chunks) == 2:
            return True  # its room was reserved at the first chunk
        return self.live + 1 <= self.cap


class _Greedy:
    def __init__(self, pp: int, m: int, v: int, placement: str, caps: list[int]):
        self.pp, self.m, self.n = pp, m, pp * v
        self.rank_of = [rank_of_chunk(c, pp, placement) for c in range(self.n)]
        self.ranks = [_Rank([c for c in range(self.n) if self.rank_of[c] == r], caps[r])
                      for r in range(pp)]
        self.next_f = [0] * self.n  # next micro-batch to go forward through chunk c
        self.next_b = [0] * self.n
        self.f_end: dict[tuple[int, int], int] = {}  # (mb, chunk) -> slot its F ended
        self.b_end: dict[tuple[int, int], int] = {}

    def _b_ready(self, c: int, t: int) -> bool:
        mb = self.next_b[c]
        if mb >= self.m or self.f_end.get((mb, c), t + 1) > t:
            return False
        return c == self.n - 1 or self.b_end.get((mb, c + 1), t + 1) <= t

    def _f_ready(self, c: int, t: int) -> bool:
        mb = self.next_f[c]
        return mb < self.m and (c == 0 or self.f_end.get((mb, c - 1), t + 1) <= t)

    def _pick(self, rank: _Rank, t: int) -> Action | None:
        for c in sorted(rank.chunks, reverse=True):
            if self._b_ready(c, t):
                return Action("B", self.next_b[c], c)
        for c in sorted(rank.chunks, reverse=True):
            if self._f_ready(c, t) and rank.can_forward(c):
                return Action("F", self.next_f[c], c)
        return rank.pending_w[0] if rank.pending_w else None

    def _run(self, rank: _Rank, a: Action, t: int) -> None:
        rank.order.append(a)
        key = (a.mb, a.chunk)
        if a.op == "F":
            self.next_f[a.chunk] += 1
            self.f_end[key] = t + 1
            rank.live += 1
            if len(rank.chunks) == 2:
                rank.reserved += 1 if a.chunk == rank.chunks[0] else -1
        elif a.op == "B":
            self.next_b[a.chunk] += 1
            self.b_end[key] = t + 1
            rank.pending_w.append(Action("W", a.mb, a.chunk))
        else:
            rank.pending_w.popleft()
            rank.live -= 1

    def play(self) -> list[list[Action]]:
        total = 3 * self.m * self.n
        done, t = 0, 0
        while done < total:
            picks = [(rank, self._pick(rank, t)) for rank in self.ranks]
            moved = [(rank, a) for rank, a in picks if a is not None]
            if not moved:  # every action takes one slot: nothing is in flight either
                raise ScheduleError(f"greedy schedule stuck at slot {t}: the memory limits "
                                    f"{[r.cap for r in self.ranks]} admit no progress")
            for rank, a in moved:
                self._run(rank, a, t)
            done += len(moved)
            t += 1
        return [rank.order for rank in self.ranks]


def greedy_orders(pp: int, m: int, v: int, placement: str, caps: list[int]) -> list[list[Action]]:
    """Per-rank compute orders (F, B, W) under per-rank activation limits ``caps`` (in chunk
    activations), played slot by slot as the module doc describes."""
    return _Greedy(pp, m, v, placement, caps).play()


def zb_h2(pp, m, v):
    """ZB-H2 (Qi et al. 2023, sec. 3.2): rank r may hold 2(pp-r)-1 micro-batches (ZB-H1 holds
    pp-r), so warm-up runs more forwards and the bubble before the first B is filled; W's fill the
    tail, so the shape is a parallelogram: with F = B = W no rank idles between its first and last
    action. Peak activations 2pp-1 on rank 0, about twice 1F1B's pp. Here the optimizer step
    stays synchronous (after the flush), so the corners of the parallelogram (rank r idles r
    slots before and pp-1-r after) remain; the paper's optimizer post-validation, which would let
    the next step start in them, is not implemented."""
    return greedy_orders(pp, m, 1, "loop", [2 * pp - 1] * pp)


def v_half(pp, m, v):
    """V-Half (Qi et al. 2024): the V placement with (pp+2)//2 micro-batches' worth of activations
    per rank, about half of 1F1B's pp; bubble about pp/(2m)."""
    return greedy_orders(pp, m, 2, "v", [2 * ((pp + 2) // 2)] * pp)


def v_min(pp, m, v):
    """V-Min (Qi et al. 2024): the V placement with (pp+4)//3 micro-batches' worth of activations
    per rank, about a third of 1F1B's; bubble about 2pp/(3m)."""
    return greedy_orders(pp, m, 2, "v", [2 * ((pp + 4) // 3)] * pp)
