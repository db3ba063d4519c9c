"""Generators of the classic pipeline schedules, as per-rank action lists (no MPI here).

Each generator first decides the order of the *compute* actions (F, B, W, BW, UPDATE) on every
rank, which is what the papers describe. ``_add_communication`` then places the sends right after
the producing compute and the receives right before the consuming compute, choosing their order
inside each gap so that the whole schedule cannot deadlock even if every send blocks until its
receive is posted (rendezvous semantics, what ``check_schedule`` enforces).
"""

from __future__ import annotations

from collections import deque

from . import dualpipe, greedy, pipedream, zbv
from .actions import (
    Action,
    Schedule,
    ScheduleError,
    matching,
    rank_of_chunk,
    recvs_before,
    sends_after,
)
from .pipedream import CONTINUOUS, one_f_one_b, validate_continuous  # noqa: F401
from .replay import UNIT_COSTS, Replay
from .versions import weight_versions  # noqa: F401  (re-exported: PipeDream's versions)

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "zb-h2", "zb-v",
             "looped-bfs", "v-half", "v-min", "dualpipev", "pipedream-2bw")
# Schedules whose two chunks per rank sit in a V (actions.py); every other one places in a loop.
V_SHAPED = ("zb-v", "v-half", "v-min", "dualpipev")
MULTI_CHUNK = ("interleaved", "looped-bfs")  # virtual_stages >= 2, loop placement
# Schedules whose receivers take data early when it is already there (see _early_receive): the
# V's ranks feed two neighbours, looped BFS streams a whole chunk's micro-batches. The others keep
# the plain placement, which is already bubble-optimal for them.
EARLY_RECEIVES = V_SHAPED + ("looped-bfs",)


def placement_of(kind: str) -> str:
    return "v" if kind in V_SHAPED else "loop"


def default_virtual_stages(kind: str) -> int:
    return 2 if kind in V_SHAPED or kind in MULTI_CHUNK else 1


def build_schedule(kind: str, pp: int, microbatches: int, virtual_stages: int = 1, *,
                   steps: int | None = None, vertical_sync: bool = False) -> Schedule:
    """Build and return the schedule ``kind`` for ``pp`` ranks and ``microbatches`` micro-batches,
    ``virtual_stages`` model chunks per rank.

    ``steps``: PipeDream / PipeDream-2BW without a flush: the continuous schedule of ``steps``
    training steps (``continuous``); ``vertical_sync``: PipeDream's vertical sync.
    Raises ScheduleError (a ValueError) with a message saying what to change for bad settings.
    """
    validate(kind, pp, microbatches, virtual_stages, steps=steps, vertical_sync=vertical_sync)
    if steps is not None or vertical_sync:
        return continuous(kind, pp, microbatches, steps or 1, vertical_sync)
    orders = _ORDERS[kind](pp, microbatches, virtual_stages)
    placement = placement_of(kind)
    ranks, pairs = _place(pp, pp * virtual_stages, orders, placement,
                          early_receives=kind in EARLY_RECEIVES)
    return Schedule(kind, pp, virtual_stages, microbatches, ranks,
                    asynchronous=(kind == "pipedream"), placement=placement, pairs=pairs)


def validate(kind: str, pp: int, microbatches: int, virtual_stages: int = 1, *,
             steps: int | None = None, vertical_sync: bool = False) -> None:
    """Check a schedule's settings without building it (cheap; call before any MPI work)."""
    if steps is not None or vertical_sync:
        validate_continuous(kind, pp, microbatches, steps, vertical_sync)
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; valid schedules: {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    _validate_chunks(kind, pp, microbatches, virtual_stages)
    if kind == "naive" and microbatches != 1:
        raise ScheduleError(
            f"the naive schedule does not split the batch (microbatches must be 1, got "
            f"{microbatches}); use microbatches=1, or gpipe/1f1b for micro-batching"
        )


def _validate_chunks(kind, pp, microbatches, virtual_stages):
    """Model chunks per rank, and the micro-batch counts that multi-chunk schedules need."""
    if kind in V_SHAPED and virtual_stages != 2:
        raise ScheduleError(
            f"{kind} places two model chunks per rank in a V: set virtual_stages=2 (got "
            f"virtual_stages={virtual_stages})"
        )
    if kind in MULTI_CHUNK and virtual_stages < 2:
        raise ScheduleError(
            f"the {kind} schedule needs virtual_stages >= 2 model chunks per rank (got "
            f"virtual_stages={virtual_stages}); set virtual_stages to 2 or more, or use the "
            f"{'1f1b' if kind == 'interleaved' else 'gpipe'} schedule"
        )
    if kind not in V_SHAPED and kind not in MULTI_CHUNK and virtual_stages != 1:
        raise ScheduleError(
            f"virtual_stages={virtual_stages} is only meaningful for the interleaved, looped-bfs "
            f"and V-shaped ({', '.join(V_SHAPED)}) schedules; use virtual_stages=1 with {kind!r}"
        )
    if kind == "interleaved" and microbatches % pp:
        lo = microbatches - microbatches % pp
        hint = f"{lo} or {lo + pp}" if lo else f"{pp}"
        raise ScheduleError(
            f"the interleaved schedule needs microbatches to be a multiple of pp={pp} "
            f"(got {microbatches}); use microbatches={hint}"
        )
    if kind == "dualpipev" and microbatches < 2 * pp:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2 * pp = {2 * pp} (got {microbatches}): its main "
            f"phase pairs forwards and backwards of different micro-batches"
        )


# ----------------------------------------------------------------------------------------------
# Compute orders, one function per schedule: (pp, m, v) -> list per rank of compute Actions.


def _naive(pp, m, v):
    # One micro-batch: forward down the stages, backward up. Only one device works at a time.
    return [[Action("F", 0, r), Action("BW", 0, r)] for r in range(pp)]


def _gpipe(pp, m, v):
    # Huang et al. 2019: all forwards, then all backwards (last micro-batch first, which the last
    # stage can start right after its last forward), then the flush (optimizer step).
    return [
        [Action("F", j, r) for j in range(m)] + [Action("BW", j, r) for j in reversed(range(m))]
        for r in range(pp)
    ]


def continuous(kind: str, pp: int, m: int, steps: int, vertical_sync: bool = False) -> Schedule:
    """PipeDream or PipeDream-2BW across ``steps`` training steps with no flush
    (``pipedream.continuous_orders``), with sends and receives placed."""
    ranks, _ = _place(pp, pp, pipedream.continuous_orders(kind, pp, m, steps))
    return Schedule(kind, pp, 1, m, ranks, asynchronous=True, steps=steps,
                    vertical_sync=vertical_sync)


def forward_only(pp: int, microbatches: int, virtual_stages: int = 1,
                 placement: str = "loop") -> Schedule:
    """Evaluation: every micro-batch through every chunk in order, no backward.

    Each rank walks (micro-batch, chunk) in lexicographic order and every F depends only on a
    lexicographically earlier F, so the earliest unfinished action can always run: no deadlock.
    Neighbouring chunks on one rank (``placement`` v) pass the activation in memory.
    """
    n = pp * virtual_stages
    ranks = [[] for _ in range(pp)]

    def where(c):
        return rank_of_chunk(c, pp, placement)

    for mb in range(microbatches):
        for c in range(n):
            r = ranks[where(c)]
            if c > 0 and where(c - 1) != where(c):
                r.append(Action("RECV_F", mb, c))
            r.append(Action("F", mb, c))
            if c < n - 1 and where(c + 1) != where(c):
                r.append(Action("SEND_F", mb, c))
    return Schedule(kind="forward", pp=pp, virtual_stages=virtual_stages, microbatches=microbatches,
                    ranks=ranks, placement=placement)


def _1f1b(pp, m, v):
    return [one_f_one_b(pp, m, r) for r in range(pp)]


def _interleaved(pp, m, v):
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, SC'21, and schedules.py).

    Rank r holds chunks r, r+pp, ... Micro-batches go through the local chunks in groups of pp:
    forward step k handles micro-batch (k // (pp*v))*pp + k % pp on local chunk (k // pp) % v;
    backward step k the same micro-batch on local chunk v-1-(k // pp) % v. Warm-up has
    (pp-r-1)*2 + (v-1)*pp forward steps (all of them when m == pp, as in Megatron).
    """
    total = m * v

    def step(k, forward, r):  # -> (mb, global chunk)
        mb = (k // (pp * v)) * pp + k % pp
        local = (k // pp) % v
        return mb, (local if forward else v - 1 - local) * pp + r

    out = []
    for r in range(pp):
        warm = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [Action("F", *step(k, True, r)) for k in range(warm)]
        for i in range(total - warm):
            acts += [Action("F", *step(warm + i, True, r)), Action("BW", *step(i, False, r))]
        acts += [Action("BW", *step(k, False, r)) for k in range(total - warm, total)]
        out.append(acts)
    return out


def _zb_h1(pp, m, v):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1).

    Backward split into B (input gradient, on the critical path) and W (weight gradient, free to
    move). Rank r runs min(pp-r, m) forwards, then for each micro-batch j: B(j); W of the oldest
    pending micro-batch once r weight-gradients are deferred (j >= r); the next F if any left.
    The last W's fill the cool-down, where 1F1B idles. At most pp micro-batches hold activations
    (released at W) on any rank: the same peak as 1F1B's first stage. With F = B = W = 1 the
    idle time per rank is pp-1 instead of 1F1B's 3(pp-1) (for m >= pp).
    """
    out = []
    for r in range(pp):
        warm = min(pp - r, m)
        acts = [Action("F", j, r) for j in range(warm)]
        next_f, pending_w = warm, deque()
        for j in range(m):
            acts.append(Action("B", j, r))
            pending_w.append(j)
            if j >= r:
                acts.append(Action("W", pending_w.popleft(), r))
            if next_f < m:
                acts.append(Action("F", next_f, r))
                next_f += 1
        acts += [Action("W", j, r) for j in pending_w]
        out.append(acts)
    return out


def _looped_bfs(pp, m, v):
    """Breadth-first (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism"; torch's
    ScheduleLoopedBFS): rank r runs every micro-batch through its first chunk, then its next one,
    ...; then the full backwards, last local chunk first, micro-batches in reverse. GPipe over
    the v chunks of each rank: bubble (pp-1)/(v m + pp-1), activations of all m micro-batches."""
    out = []
    for r in range(pp):
        local = [k * pp + r for k in range(v)]
        acts = [Action("F", j, c) for c in local for j in range(m)]
        acts += [Action("BW", j, c) for c in reversed(local) for j in reversed(range(m))]
        out.append(acts)
    return out


_ORDERS = {
    "naive": _naive,
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
    "pipedream": pipedream.pipedream,
    "zb-h2": greedy.zb_h2,
    "zb-v": zbv.zb_v,
    "looped-bfs": _looped_bfs,
    "v-half": greedy.v_half,
    "v-min": greedy.v_min,
    "dualpipev": dualpipe.dualpipev,
    # PipeDream-2BW's numerics (the trainer's one-step-delayed update) on the 1F1B order; the
    # pipeline still drains at each step here
    "pipedream-2bw": _1f1b,
}


# ----------------------------------------------------------------------------------------------
# Communication placement.


def _parts(item) -> list[Action]:
    """A compute order's item: one Action, or a tuple (F, B) run as one paired action."""
    return list(item) if isinstance(item, tuple) else [item]


class _Placement(Replay):
    """Replays the compute orders, deciding where each send and receive goes (see below).

    A paired item (F, B) of the compute order (DualPipeV's F&B) is one unit: the receives of
    both halves come before it and the sends of both after it, so nothing separates the two."""

    greedy = False  # one compute per rank per round, then messages again

    def __init__(self, pp: int, n_chunks: int, orders: list[list[Action]], placement: str,
                 early_receives: bool = False):
        super().__init__(orders)
        self.early_receives = early_receives
        self.pp, self.n_chunks, self.v = pp, n_chunks, n_chunks // pp
        self.rank_of = lambda c: rank_of_chunk(c, pp, placement)
        self.out: list[list[Action]] = [[] for _ in range(pp)]
        self.pending: list[dict[Action, float]] = [{} for _ in range(pp)]  # send -> time made
        self.received: list[set[Action]] = [set() for _ in range(pp)]
        self.clock = [0.0] * pp  # estimated time each rank reaches its current point
        self.arrival: dict[Action, float] = {}  # receive -> time its data was made
        self.pairs: list[tuple[int, int]] = []  # (rank, index of the F of a paired action)

    def needed(self, r: int) -> list[Action]:
        if self.done(r):
            return []
        return [x for a in _parts(self.current(r))
                for x in recvs_before(a, self.n_chunks, self.rank_of)
                if x not in self.received[r]]

    def can_run(self, r: int, a: Action) -> bool:
        # computes once its receives are done and its sends are out
        return not self.needed(r) and not self.pending[r]

    def run(self, r: int, item) -> None:
        if isinstance(item, tuple):
            self.pairs.append((r, len(self.out[r])))
        for a in _parts(item):
            self.out[r].append(a)
            ready = max([self.clock[r]] + [self.arrival[x] for x in
                                           recvs_before(a, self.n_chunks, self.rank_of)])
            self.clock[r] = ready + UNIT_COSTS[a.op] / self.v
            for s in sends_after(a, self.n_chunks, self.rank_of):
                self.pending[r][s] = self.clock[r]

    def before_round(self) -> bool:
        """Exchange the oldest message whose receiver needs it now."""
        best = None
        for r in range(self.pp):
            for recv in self.needed(r):
                send = matching(recv)
                src = self.rank_of(send.chunk)
                if send in self.pending[src]:
                    # Oldest first; on a tie, a receiver with no sends of its own to hold up.
                    key = (self.pending[src][send], bool(self.pending[r]), src)
                    if best is None or key < best[0]:
                        best = (key, src, send, r, recv)
        if best is None and self.early_receives:
            best = self._early_receive()
        if best is None:
            return False
        _, src, send, r, recv = best
        self.arrival[recv] = self.pending[src].pop(send)
        self.out[src].append(send)
        self.out[r].append(recv)
        self.received[r].add(recv)
        return True

    def _early_receive(self):
        """A pending send whose receiver, though it does not need the data yet, is already past
        the time the data was made (estimated): it takes it now, so the sender can go on.
        Without this a rank that feeds two neighbours (V placement) stalls on every send."""
        best = None
        for src in range(self.pp):
            for send, made in self.pending[src].items():
                recv = matching(send)
                r = self.rank_of(recv.chunk)
                if recv not in self.received[r] and not self.done(r) and self.clock[r] >= made:
                    key = (made, src)
                    if best is None or key < best[0]:
                        best = (key, src, send, r, recv)
        return best

    def unstick(self) -> bool:
        """Let the lowest ready rank go on with its sends still pending."""
        ready = [r for r in self.unfinished() if not self.needed(r)]
        if ready:
            self.step(ready[0])
        return bool(ready)

    def stuck(self) -> Exception:
        blocked = [f"rank {r} at {self.current(r)}" for r in self.unfinished()]
        return ScheduleError("compute orders deadlock: " + "; ".join(blocked))

    def finish(self) -> list[list[Action]]:
        if any(self.pending):
            left = [str(a) for p in self.pending for a in p]
            raise ScheduleError(f"sends with no receiver: {', '.join(left)}")
        return self.out


def _add_communication(pp: int, n_chunks: int, orders: list[list[Action]],
                       placement: str = "loop", early_receives: bool = False
                       ) -> list[list[Action]]:
    """Insert SEND/RECV actions into per-rank compute orders, deadlock-free under rendezvous.

    We play one global execution in which every send meets its receive at one instant; each
    rank's list is its events in that execution, so the execution itself proves the schedule
    cannot deadlock with blocking sends. A rank between two computes has sends pending from the
    last one and receives needed by the next one; among all sender/receiver pairs that are ready,
    the message produced earliest (estimated with ``UNIT_COSTS``, F=B=W=1, BW=2) is exchanged
    first, so that in real time no rank waits on a receive while holding a send it could have
    made. A rank computes once its receives are done and its sends are out. Only if nothing else
    can move does a rank go on with sends still pending (the send then follows a later compute).
    """
    return _place(pp, n_chunks, orders, placement, early_receives)[0]


def _place(pp, n_chunks, orders, placement="loop", early_receives=False):
    """(per-rank action lists, paired actions as (rank, index of the F)): see above."""
    if pp == 1:  # every chunk on one rank: plain gradient accumulation, nothing to send
        flat, pairs = [], []
        for item in orders[0]:
            if isinstance(item, tuple):
                pairs.append((0, len(flat)))
            flat += _parts(item)
        return [flat], pairs
    placed = _Placement(pp, n_chunks, orders, placement, early_receives)
    return placed.play(), sorted(placed.pairs)
