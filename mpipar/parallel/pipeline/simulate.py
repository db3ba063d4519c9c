"""Cost-model simulation of a schedule: step time, bubble fraction, peak activations held.

Each rank runs its actions in order (a ``replay.Replay``). Two cost inputs:

- a plain dict (``{"F": 1, "BW": 2, "comm": 0}``, ``mpipar schedule --costs``): one cost per
  action kind and stage for every rank (a chunk costs 1/``virtual_stages`` of it), a send costs
  its sender nothing (non-blocking, as in the executor), a receive completes ``comm`` after its
  matching send started, or at once if that is already past;
- a ``CostModel`` (fitted from a dump by ``mpipar.analysis.predict``): the cost of every
  (rank, chunk, op), a per-action overhead (executor dispatch, posting and testing requests),
  point-to-point latency + bytes / bandwidth, data-parallel bucket reductions that overlap the
  backward, the gradient-norm collective every rank meets at, the optimizer step, and a fixed
  per-step overhead. The step is then: every rank's actions, its bucket reductions, the norm
  collective (all ranks), the slowest optimizer step, the fixed rest.

The simulation is deterministic: no randomness, ties broken by rank order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .actions import Action, Schedule, ScheduleError, matching
from .formulas import textbook_bubble  # noqa: F401  (its home; imported from here too)
from .replay import UNIT_COSTS, Replay

DEFAULT_COSTS = UNIT_COSTS
COMPUTE_OPS = ("F", "B", "W", "BW", "UPDATE")


@dataclass
class CostModel:
    """Costs in seconds (or any unit, consistently).

    ``unit``: per-stage cost of each op (a chunk costs ``unit[op] / virtual_stages``), used where
    ``per_unit`` has no entry; ``per_unit[(rank, chunk, op)]``: the cost of that op on that chunk
    and rank (not divided by v). ``overhead``: added to every action. ``send_post`` /
    ``recv_post``: the cost of a SEND / RECV action itself (posting, testing, copying).
    ``latency`` + bytes / ``bandwidth``: the time from a send to its receive being possible;
    ``message_bytes[(op, chunk)]`` (op SEND_F / SEND_B) or ``default_bytes`` the payload.
    ``dp_reduce[(rank, chunk)]``: the bucket reduction of a chunk's gradients, started when the
    chunk's last weight pass ends (``dp_overlap``) or after the rank's last action; reductions of
    one rank run one after another. ``sync``: the collective all ranks meet at after the pipeline
    (gradient norm). ``optimizer[rank]``: the optimizer step. ``step_pre`` / ``step_post``: fixed
    time before the first action and after the optimizer (batch fetch, loss all-reduce, ...);
    ``step_gap``: a continuous run's time between one call and the next on a rank (the training
    loop's own work), which a neighbour waiting for this rank's messages sees.
    ``per_rank[(rank, name)]``: a rank's own value of ``overhead``, ``sync``, ``step_pre``,
    ``step_post`` or ``step_gap`` where it has one (``of``): a continuous run's ranks never meet,
    so each keeps its own pace (the first stage stashes and reads inputs, the last computes the
    loss), and a median over ranks would hand the slower one's fixed costs to the faster.
    ``call_gap[(rank, k)]``: the time between rank's call k and call k + 1 where measured (a
    dump flush or a collection pause between two calls: the neighbour waiting for this rank's
    next message waits through it), else ``step_gap``.
    ``stash[(rank, chunk, op)]``: an asynchronous schedule's weight-version work before each
    such action (the copy of a version before F, the swap and gradient zeroing before BW, the
    copy an UPDATE makes of the version it ends): on the rank's clock, not model compute.
    ``jitter``: multipliers (mean 1) that one compute's duration takes around its cost, as
    sampled from a dump (``costmodel.jitter``); ``simulate(..., draw=k)`` gives every compute
    one drawn at random (seed k); a prediction averages ``samples`` such draws.
    ``rank_jitter[rank]``: that rank's own multipliers where given (its units are other layers:
    the embedding on the first stage, head and loss on the last, with their own spread).
    ``call_part[(rank, k, name)]``: a continuous run's ``overhead``, ``sync``, ``step_pre`` or
    ``step_post`` of rank's call k where measured (a stall inside one call: a neighbour waits
    through it then, not a little in every call), before ``per_rank``.
    ``step_unit[(rank, step, chunk, op)]``: a continuous schedule's cost of that op in that
    step (its micro-batch's step, ``mb // microbatches`` in the run-long lists), before
    ``per_unit``: each step costs its own measured means, as a flushing run's prediction takes
    each step's own (a rank slow for a step stalls its neighbour in that step; a mean over the
    run spreads the slowness thin, and ``jitter`` is the spread within a step only).
    """

    unit: dict = field(default_factory=lambda: dict(DEFAULT_COSTS))
    per_unit: dict = field(default_factory=dict)
    overhead: float = 0.0
    send_post: float = 0.0
    recv_post: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    message_bytes: dict = field(default_factory=dict)
    default_bytes: float = 0.0
    dp_reduce: dict = field(default_factory=dict)
    dp_overlap: bool = True
    sync: float = 0.0
    optimizer: dict = field(default_factory=dict)
    step_pre: float = 0.0
    step_post: float = 0.0
    step_gap: float = 0.0
    stash: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)
    call_gap: dict = field(default_factory=dict)
    jitter: tuple = ()
    rank_jitter: dict = field(default_factory=dict)
    samples: int = 32
    step_unit: dict = field(default_factory=dict)
    call_part: dict = field(default_factory=dict)
    microbatches: int = 0  # of a step, for ``step_unit`` (0: no per-step costs)

    def of(self, name: str, r: int) -> float:
        """Rank r's ``name`` (``per_rank``), else the one for every rank."""
        return self.per_rank.get((r, name), getattr(self, name)) if self.per_rank \
            else getattr(self, name)

    def compute(self, r: int, a: Action, v: int) -> float:
        if self.step_unit and self.microbatches > 0 and a.mb >= 0:
            k = (r, a.mb // self.microbatches, a.chunk)
            c = self.step_unit.get((*k, a.op))
            if c is None and a.op == "BW":  # a dump records a whole backward as one B
                c = self.step_unit.get((*k, "B"))
            if c is not None:
                return c
        c = self.per_unit.get((r, a.chunk, a.op))
        if c is None and a.op == "BW" and (r, a.chunk, "B") in self.per_unit:
            c = self.per_unit[(r, a.chunk, "B")] + self.per_unit.get((r, a.chunk, "W"), 0.0)
        return c if c is not None else self.unit.get(a.op, 0.0) / v

    def transfer(self, send: Action) -> float:
        nbytes = self.message_bytes.get((send.op, send.chunk), self.default_bytes)
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)

    def check(self) -> CostModel:
        for name in ("overhead", "send_post", "recv_post", "latency", "sync", "step_pre",
                     "step_post", "default_bytes"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or val < 0 or math.isnan(val):
                raise ScheduleError(f"cost model: {name} must be a number >= 0, got {val!r}")
        if not self.bandwidth > 0:
            raise ScheduleError(f"cost model: bandwidth must be > 0, got {self.bandwidth!r}")
        for name, d in (("stash", self.stash), ("per_rank", self.per_rank),
                        ("call_gap", self.call_gap), ("step_unit", self.step_unit),
                        ("call_part", self.call_part)):
            if any(not isinstance(x, (int, float)) or not x >= 0 for x in d.values()):
                raise ScheduleError(f"cost model: {name} costs must be numbers >= 0")
        if any(not isinstance(x, (int, float)) or not x >= 0
               for x in (*self.jitter, *(y for q in self.rank_jitter.values() for y in q))):
            raise ScheduleError("cost model: jitter must be multipliers >= 0")
        if self.step_unit and not (isinstance(self.microbatches, int) and self.microbatches > 0):
            raise ScheduleError("cost model: step_unit needs microbatches (per step) >= 1, "
                                f"got {self.microbatches!r}")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ScheduleError(f"cost model: samples must be an int >= 1, got {self.samples!r}")
        for table in (self.unit, self.per_unit, self.dp_reduce, self.optimizer):
            for k, val in table.items():
                if not isinstance(val, (int, float)) or val < 0:
                    raise ScheduleError(f"cost model: cost {k} must be a number >= 0, "
                                        f"got {val!r}")
        return self


@dataclass
class SimResult:
    makespan: float  # end of the last action on any rank (the pipeline)
    busy: list[float]  # compute time per rank
    bubble_fraction: float  # mean over ranks of idle / makespan
    per_rank_bubble: list[float]
    peak_activations: list[int]  # max (mb, chunk) pairs with F done and activations not freed
    timeline: list[list[tuple[float, float, Action]]] = field(default_factory=list)
    # with a CostModel: the whole step and what each rank spent on communication
    step_time: float = 0.0
    step_bubble: float = 0.0  # mean over ranks of 1 - model compute (no optimizer) / step
    comm: list[float] = field(default_factory=list)  # p2p, dp, waits in the step's collectives
    pipe_comm: list[float] = field(default_factory=list)  # p2p and dp only (no collective waits)
    overhead: list[float] = field(default_factory=list)  # per-action overhead per rank
    pipeline_end: list[float] = field(default_factory=list)  # per rank, with its dp reduction
    dp_timeline: list[list[tuple[float, float, int]]] = field(default_factory=list)


def resolve_costs(costs: dict | None) -> dict:
    """Defaults filled in; BW defaults to B + W when only those are given."""
    out = dict(DEFAULT_COSTS)
    if costs:
        unknown = set(costs) - set(DEFAULT_COSTS)
        if unknown:
            raise ScheduleError(
                f"unknown cost name(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(DEFAULT_COSTS)}"
            )
        for k, val in costs.items():
            if not isinstance(val, (int, float)) or val < 0:
                raise ScheduleError(f"cost {k} must be a number >= 0, got {val!r}")
        out.update({k: float(val) for k, val in costs.items()})
        if "BW" not in costs and ("B" in costs or "W" in costs):
            out["BW"] = out["B"] + out["W"]
    return out


def as_model(costs) -> CostModel:
    """A ``CostModel`` as given (checked), or the one a plain per-kind dict describes."""
    if isinstance(costs, CostModel):
        return costs.check()
    unit = resolve_costs(costs)
    return CostModel(unit=unit, latency=unit["comm"])


class _Timed(Replay):
    """Each rank's clock: sends post and go on, a receive waits for its send's arrival."""

    def __init__(self, s: Schedule, model: CostModel, draw=None):
        super().__init__(s.ranks)
        pp = s.pp
        self.model, self.v = model, s.virtual_stages
        # one multiplier per action, drawn up front so that the visiting order cannot change them
        self.scale = None
        if draw is not None and model.jitter:
            rng = np.random.default_rng(draw)
            pools = [np.asarray(model.rank_jitter.get(r, model.jitter), dtype=float)
                     for r in range(pp)]
            self.scale = [pool[rng.integers(0, len(pool), len(acts))]
                          for pool, acts in zip(pools, s.ranks)]
        self.now = [model.step_pre] * pp
        self.busy = [0.0] * pp
        self.comm = [0.0] * pp
        self.over = [0.0] * pp
        self.sent: dict[Action, float] = {}  # send action -> time its message can be received
        self.live = [0] * pp
        self.peak = [0] * pp
        self.last_w = {}  # (rank, chunk) -> end of its last weight pass so far
        self.timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]

    def can_run(self, r: int, a: Action) -> bool:
        # a receive whose send has not been reached yet waits: try other ranks
        return not a.op.startswith("RECV") or matching(a) in self.sent

    def run(self, r: int, a: Action) -> None:
        m = self.model
        start = self.now[r]
        if a.op.startswith("SEND"):
            end = start + m.send_post
            self.sent[a] = end + m.transfer(a)
            self.comm[r] += m.send_post
        elif a.op.startswith("RECV"):
            end = max(start, self.sent[matching(a)]) + m.recv_post
            self.comm[r] += end - start
        else:
            prep = m.stash.get((r, a.chunk, a.op), 0.0) if m.stash else 0.0
            self.over[r] += prep
            start += prep  # the weight version first (``CostModel.stash``), then the compute
            cost = m.compute(r, a, self.v)
            if self.scale is not None:
                cost *= float(self.scale[r][self.pos[r] - 1])  # pos is past this action
            end = start + cost
            self.busy[r] += end - start
            self._count_activations(r, a)
            if a.op in ("W", "BW"):
                self.last_w[(r, a.chunk)] = end
        self.timeline[r].append((start, end, a))
        over = self.part("overhead", r)
        self.now[r] = end + over
        self.over[r] += over

    def part(self, name: str, r: int) -> float:
        """Rank r's fixed cost ``name`` (``CostModel.of``)."""
        return self.model.of(name, r)

    def _count_activations(self, r: int, a: Action) -> None:
        if a.op == "F":
            self.live[r] += 1
            self.peak[r] = max(self.peak[r], self.live[r])
        elif a.op == "BW" or a.op == "W":
            self.live[r] -= 1  # activations of (mb, chunk) released

    def stuck(self) -> Exception:
        stuck = [f"rank {r} at {self.current(r)}" for r in self.unfinished()]
        return ScheduleError(
            "simulation stuck (receives whose sends never come): " + "; ".join(stuck)
        )

    def reductions(self, r: int) -> tuple[float, list]:
        """When rank r's data-parallel reductions end (its actions' end if it has none)."""
        m, t, spans = self.model, self.now[r], []
        chunks = sorted({c for (q, c) in m.dp_reduce if q == r},
                        key=lambda c: self.last_w.get((r, c), t))
        for c in chunks:
            start = max(t if not spans else spans[-1][1],
                        self.last_w.get((r, c), t) if m.dp_overlap else self.now[r])
            spans.append((start, start + m.dp_reduce[(r, c)], c))
            self.comm[r] += m.dp_reduce[(r, c)]
        return max([self.now[r]] + [e for _, e, _ in spans]), spans


class _Stepped(_Timed):
    """``_Timed`` over a continuous schedule run a step at a time: rank r's call k runs its
    actions (in ``order[r]``) up to ``cuts[r][k]``, then posts and reads its share of the lagged
    loss reduction (``sync``, on its own clock: the ranks never meet there,
    ``training/lagged.py``), and after ``step_post``, ``step_gap`` (between the calls) and
    ``step_pre`` starts call k + 1. Ranks
    wait for one another only in their receives, as the executor does."""

    def __init__(self, s: Schedule, model: CostModel, order, cuts, draw=None):
        super().__init__(s, model, draw)
        self.streams, self.cuts = order, cuts
        self.k = [0] * len(order)  # each rank's call in progress
        self.spans = [[] for _ in order]  # per rank, per call: its span, start to end
        self.call_start = [0.0] * len(order)
        self.now = [self.part("step_pre", r) for r in range(len(order))]

    def part(self, name: str, r: int) -> float:
        """``name`` of rank r's call in progress where measured (``CostModel.call_part``)."""
        got = self.model.call_part.get((r, self.k[r], name)) if self.model.call_part else None
        return got if got is not None else self.model.of(name, r)

    def can_run(self, r: int, a: Action) -> bool:
        k = self.k[r]
        return k < len(self.cuts[r]) and self.pos[r] < self.cuts[r][k] and super().can_run(r, a)

    def before_round(self) -> bool:
        m, moved = self.model, False
        for r in range(len(self.streams)):
            while self.k[r] < len(self.cuts[r]) and self.pos[r] >= self.cuts[r][self.k[r]]:
                end = self.now[r] + self.part("sync", r) + self.part("step_post", r)
                self.spans[r].append(end - self.call_start[r])
                gap = m.call_gap.get((r, self.k[r]), m.of("step_gap", r)) if m.call_gap \
                    else m.of("step_gap", r)
                self.call_start[r] = end + gap
                self.k[r] += 1
                self.now[r] = end + gap + self.part("step_pre", r)
                moved = True
        return moved


def simulate_steps(s: Schedule, model: CostModel, order, cuts, draw=None) -> tuple:
    """(``SimResult`` with the timeline, per rank [span of each of its calls]) of continuous
    schedule ``s`` run a step at a time (``_Stepped``; ``order[r]``: rank r's actions as its
    executor runs them, ``cuts[r]``: ``continuous.step_cuts`` of them)."""
    model = as_model(model)
    sim = _Stepped(s, model, order, cuts, draw)
    sim.play()
    makespan = max((t - model.of("step_gap", r) for r, t in enumerate(sim.call_start)),
                   default=0.0)  # the last call's end
    per_rank = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in sim.busy]
    return SimResult(makespan=makespan, busy=sim.busy,
                     bubble_fraction=sum(per_rank) / s.pp if s.pp else 0.0,
                     per_rank_bubble=per_rank, peak_activations=sim.peak,
                     timeline=sim.timeline, comm=sim.comm, overhead=sim.over), sim.spans


def simulate(s: Schedule, costs: dict | CostModel | None = None, draw=None) -> SimResult:
    """One timed replay of ``s``. ``draw``: with a ``CostModel`` that has ``jitter``, the seed
    (an int or a tuple of ints) of the multipliers its computes take (None: each at its cost)."""
    pp = s.pp
    model = as_model(costs)
    sim = _Timed(s, model, draw)
    sim.play()
    makespan = max(sim.now) if pp else 0.0
    per_rank = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in sim.busy]
    ends, dp_spans = zip(*(sim.reductions(r) for r in range(pp)), strict=True) if pp else ((), ())
    meet = max(ends, default=0.0) + model.sync
    opt = max((model.optimizer.get(r, 0.0) for r in range(pp)), default=0.0)
    step = meet + opt + model.step_post
    return SimResult(
        makespan=makespan,
        busy=sim.busy,
        bubble_fraction=sum(per_rank) / pp if pp else 0.0,
        per_rank_bubble=per_rank,
        peak_activations=sim.peak,
        timeline=sim.timeline,
        step_time=step,
        step_bubble=(sum(1 - b / step for b in sim.busy) / pp) if pp and step > 0 else 0.0,
        # as a dump counts it: waits inside the norm and loss collectives are communication
        comm=[c + (meet - e) + (opt - model.optimizer.get(r, 0.0))
              for r, (c, e) in enumerate(zip(sim.comm, ends, strict=True))],
        pipe_comm=list(sim.comm),
        overhead=sim.over,
        pipeline_end=list(ends),
        dp_timeline=[list(x) for x in dp_spans],
    )
