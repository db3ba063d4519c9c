"""ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 6): compute orders, no MPI.

Two chunks per rank in a V: rank r holds chunk r (its "a" chunk, on the way down) and chunk
2pp-1-r (its "b" chunk, on the way up; rank 0's b chunk holds the loss). With F = B = W the
hand-made order below leaves no idle slot between a rank's first and last action once
microbatches >= 2pp-1, while each rank holds at most pp micro-batches' worth of activations
(2pp chunk activations): 1F1B's first-stage peak. The phases (as torch's ScheduleZBVZeroBubble
and the paper's figure 8):

1. warm-up: 2(pp-r)-1 forwards of chunk a; then r pairs (F of b, F of a); then pp-r rounds of
   F, B, W of chunk b (the loss side fills first);
2. steady: F of a (while any are left), B and W of a, F, B and W of b;
3. cool-down: r pairs (B of a, B of b), then pp-r rounds (B of a, W of a), then the W's left.

With fewer micro-batches every phase is cut at m (each count is capped by what is left), which
stays correct, just not bubble-free.
"""

from __future__ import annotations

from .actions import Action


class _Counts:
    def __init__(self, m: int, a: int, b: int):
        self.m, self.a, self.b = m, a, b
        self.n = {(op, c): 0 for op in "FBW" for c in (a, b)}
        self.acts: list[Action] = []

    def left(self, op: str, c: int) -> bool:
        return self.n[(op, c)] < self.m

    def do(self, op: str, c: int) -> None:
        if self.left(op, c):
            self.acts.append(Action(op, self.n[(op, c)], c))
            self.n[(op, c)] += 1


def _rank_order(pp: int, m: int, r: int) -> list[Action]:
    k = _Counts(m, r, 2 * pp - 1 - r)
    a, b = k.a, k.b
    for _ in range(2 * (pp - r) - 1):
        k.do("F", a)
    for _ in range(r):
        k.do("F", b)
        k.do("F", a)
    for _ in range(pp - r):
        for op in "FBW":
            k.do(op, b)
    while k.left("F", a) or k.n[("F", b)] < k.n[("F", a)]:
        k.do("F", a)
        for step in (("B", a), ("W", a), ("F", b), ("B", b), ("W", b)):
            k.do(*step)
    for _ in range(r):
        k.do("B", a)
        k.do("B", b)
    for _ in range(pp - r):
        k.do("B", a)
        k.do("W", a)
    while k.left("W", b) or k.left("W", a):
        k.do("W", b if k.left("W", b) else a)
    return k.acts


def zb_v(pp, m, v):
    return [_rank_order(pp, m, r) for r in range(pp)]
