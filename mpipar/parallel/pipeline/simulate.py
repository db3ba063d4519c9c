"""Cost-model simulation of a schedule: makespan, bubble fraction, peak activations held.

Each rank runs its actions in order (a ``replay.Replay``). A compute action takes its cost (per
stage, divided by ``virtual_stages``: a chunk is 1/v of a stage). A send costs the sender nothing
(non-blocking, as in the executor); a receive completes ``comm`` after its matching send started,
or at once if that is already past. The simulation is deterministic: no randomness, ties broken
by rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Schedule, ScheduleError, matching
from .replay import UNIT_COSTS, Replay

DEFAULT_COSTS = UNIT_COSTS


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per rank
    bubble_fraction: float  # mean over ranks of idle / makespan
    per_rank_bubble: list[float]
    peak_activations: list[int]  # max (mb, chunk) pairs with F done and activations not freed
    timeline: list[list[tuple[float, float, Action]]] = field(default_factory=list)


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


class _Timed(Replay):
    """Each rank's clock: sends start at once, a receive waits for its send (plus ``comm``)."""

    def __init__(self, s: Schedule, costs: dict):
        super().__init__(s.ranks)
        pp = s.pp
        self.costs, self.v = costs, s.virtual_stages
        self.now = [0.0] * pp
        self.busy = [0.0] * pp
        self.sent: dict[Action, float] = {}  # send action -> time it started
        self.live = [0] * pp
        self.peak = [0] * pp
        self.timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]

    def can_run(self, r: int, a: Action) -> bool:
        # a receive whose send has not been reached yet waits: try other ranks
        return not a.op.startswith("RECV") or matching(a) in self.sent

    def run(self, r: int, a: Action) -> None:
        start = self.now[r]
        if a.op.startswith("SEND"):
            self.sent[a] = start
            end = start
        elif a.op.startswith("RECV"):
            end = max(start, self.sent[matching(a)] + self.costs["comm"])
        else:
            end = start + self.costs[a.op] / self.v
            self.busy[r] += end - start
            self._count_activations(r, a)
        self.timeline[r].append((start, end, a))
        self.now[r] = end

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


def simulate(s: Schedule, costs: dict | None = None) -> SimResult:
    pp = s.pp
    sim = _Timed(s, resolve_costs(costs))
    sim.play()
    makespan = max(sim.now) if pp else 0.0
    per_rank = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in sim.busy]
    return SimResult(
        makespan=makespan,
        busy=sim.busy,
        bubble_fraction=sum(per_rank) / pp,
        per_rank_bubble=per_rank,
        peak_activations=sim.peak,
        timeline=sim.timeline,
    )


def textbook_bubble(kind: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float | None:
    """The published bubble fraction, as idle time / total time (the simulator's normalisation).

    Returns None where no closed form applies: asynchronous PipeDream has no flush, so its
    bubble vanishes in the steady state; ZB-H1 with fewer micro-batches than stages; unknown
    kinds.
    """
    p, m, v = pp, microbatches, virtual_stages
    if kind == "naive":
        # One micro-batch through p stages: each device works 1/p of the time.
        return (p - 1) / p
    if kind in ("gpipe", "1f1b"):
        # GPipe (Huang et al. 2019, sec. 2.2): bubble O((p-1)/(m+p-1)); 1F1B / PipeDream-Flush
        # (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training") has the
        # same bubble, less memory: idle (p-1)(tf+tb) out of (m+p-1)(tf+tb).
        return (p - 1) / (m + p - 1)
    if kind == "interleaved":
        # Narayanan et al. 2021 (Megatron-LM, SC'21, sec. 2.2.2): bubble time / ideal time =
        # (p-1)/(v*m); as idle / total that is (p-1)/(v*m + p-1).
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1":
        # Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", sec. 3.1): ZB-H1 idles
        # (p-1)(tF + tB - tW) per rank against 1F1B's (p-1)(tF + tB + tW): a third of it with
        # tF = tB = tW = 1. Total time 3m + p - 1; the paper's schedule assumes m >= p.
        return (p - 1) / (3 * m + p - 1) if m >= p else None
    return None
