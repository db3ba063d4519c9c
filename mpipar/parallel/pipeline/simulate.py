"""Cost-model simulation of a schedule: makespan, bubble fraction, peak activations held.

Each rank runs its actions in order. A compute action takes its cost (per stage, divided by
``virtual``: a chunk is 1/v of a stage). A send costs the sender nothing (non-blocking, as in the
executor); a receive completes ``comm`` after its matching send started, or at once if that is
already past. The simulation is deterministic: no randomness, ties broken by rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Schedule, ScheduleError, matching

DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0, "comm": 0.0, "UPDATE": 0.0}


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


def simulate(s: Schedule, costs: dict | None = None) -> SimResult:
    c = resolve_costs(costs)
    pp = s.pp
    pos = [0] * pp
    now = [0.0] * pp
    busy = [0.0] * pp
    sent: dict[Action, float] = {}  # send action -> time it started
    live = [0] * pp
    peak = [0] * pp
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    while True:
        moved = False
        for r in range(pp):
            acts = s.ranks[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                start = now[r]
                if a.op.startswith("SEND"):
                    sent[a] = start
                    end = start
                elif a.op.startswith("RECV"):
                    peer = matching(a)
                    if peer not in sent:
                        break  # its send has not been reached yet: try other ranks
                    end = max(start, sent[peer] + c["comm"])
                else:
                    end = start + c[a.op] / s.virtual
                    busy[r] += end - start
                    if a.op == "F":
                        live[r] += 1
                        peak[r] = max(peak[r], live[r])
                    elif a.op == "BW" or a.op == "W":
                        live[r] -= 1  # activations of (mb, chunk) released
                timeline[r].append((start, end, a))
                now[r] = end
                pos[r] += 1
                moved = True
        if all(pos[r] == len(s.ranks[r]) for r in range(pp)):
            break
        if not moved:
            stuck = [
                f"rank {r} at {s.ranks[r][pos[r]]}" for r in range(pp) if pos[r] < len(s.ranks[r])
            ]
            raise ScheduleError(
                "simulation stuck (receives whose sends never come): " + "; ".join(stuck)
            )
    makespan = max(now) if pp else 0.0
    per_rank = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=sum(per_rank) / pp,
        per_rank_bubble=per_rank,
        peak_activations=peak,
        timeline=timeline,
    )


def textbook_bubble(kind: str, pp: int, microbatches: int, virtual: int = 1) -> float | None:
    """The published bubble fraction, as idle time / total time (the simulator's normalisation).

    Returns None where no closed form applies: asynchronous PipeDream has no flush, so its
    bubble vanishes in the steady state; ZB-H1 with fewer micro-batches than stages; unknown
    kinds.
    """
    p, m, v = pp, microbatches, virtual
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
