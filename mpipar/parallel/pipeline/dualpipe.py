"""DualPipeV (DeepSeek 2025, the "cut-in-half" DualPipe): compute orders, no MPI here.

Two chunks per rank in a V (rank r: chunk r on the way down, chunk 2pp-1-r on the way up; the
loss on rank 0). Eight phases per rank, as in DeepSeek's ``dualpipev.py`` (re-derived here with
our names): forwards of the first chunk, then alternating forwards of both chunks, then B/W/F of
the second chunk with the weight gradient split off (zero bubble), then the main phase where each
forward of one chunk is paired with a backward of the other (``F&B``, overlapped on a GPU, run one
after the other here), then the cool-down with more split backwards and the deferred W's.

A paired F&B is a tuple (F, B) in the compute order; the schedule records it (``Schedule.pairs``,
``F3.0&B1.7`` in the text form): its receives come before it and its sends after it.
A backward is a plain BW unless the phase splits it ("enable_zb"), in which case it is a B whose W
joins a first-in first-out queue drained by the W steps. Needs microbatches >= 2 pp.
"""

from __future__ import annotations

from collections import deque

from .actions import Action


class _RankOrder:
    def __init__(self, pp: int, r: int):
        self.c0, self.c1 = r, 2 * pp - 1 - r
        self.next_f = {self.c0: 0, self.c1: 0}
        self.next_b = {self.c0: 0, self.c1: 0}
        self.w_queue: deque[Action] = deque()
        self.acts: list = []  # Actions, and (F, B) tuples for the paired F&B actions

    def f(self, c):
        self.acts.append(Action("F", self.next_f[c], c))
        self.next_f[c] += 1

    def b(self, c, split=False, paired=False):
        """A backward of chunk c; ``paired``: with the forward just issued, as one F&B action."""
        mb = self.next_b[c]
        self.next_b[c] += 1
        if split:
            act = Action("B", mb, c)
            self.w_queue.append(Action("W", mb, c))
        else:
            act = Action("BW", mb, c)
        if paired:
            self.acts[-1] = (self.acts[-1], act)
        else:
            self.acts.append(act)

    def w(self):
        self.acts.append(self.w_queue.popleft())


def _rank_order(pp: int, m: int, r: int) -> list:
    o = _RankOrder(pp, r)
    c0, c1 = o.c0, o.c1
    for _ in range((pp - r - 1) * 2):  # 1: forwards of the first chunk
        o.f(c0)
    for _ in range(r + 1):  # 2: both chunks' forwards, alternating
        o.f(c0)
        o.f(c1)
    for _ in range(pp - r - 1):  # 3: B (W split off), W, F of the second chunk
        o.b(c1, split=True)
        o.w()
        o.f(c1)
    for i in range(m - 2 * pp + r + 1):  # 4: the main phase, F&B pairs
        o.f(c0)
        o.b(c1, paired=not (i == 0 and r == pp - 1))  # DeepSeek: not at the V's tip, first
        o.f(c1)
        o.b(c0, paired=True)
    for _ in range(pp - r - 1):  # 5: B of the second chunk, then an F&B pair
        o.b(c1)
        o.f(c1)
        o.b(c0, paired=True)
    split, n6 = False, r + 1
    for i in range(n6):  # 6: both chunks' backwards; the second half splits off W
        if i == n6 // 2 and r % 2 == 1:
            split = True
        o.b(c1, split)
        if i == n6 // 2 and r % 2 == 0:
            split = True
        o.b(c0, split)
    for _ in range(pp - r - 1):  # 7: W, then a split B of the first chunk
        o.w()
        o.b(c0, split=True)
    while o.w_queue:  # 8: the remaining W's
        o.w()
    return o.acts


def dualpipev(pp, m, v):
    return [_rank_order(pp, m, r) for r in range(pp)]
