"""Pipeline timing of a step from mpipar's own schedules: exact closed forms, simulator fallback.

For equal stages with per-micro-batch costs F, B, W per stage (BW = B + W), the makespans
mpipar's simulator gives exactly (``simulate(build_schedule(...))``, sends free;
tests/test_plan.py checks them) are ``mpipar.parallel.pipeline.formulas.makespan`` (strict), the
one home of the closed forms (gpipe/1f1b (m + p - 1)(F + BW), interleaved, zb-h1, naive);
and at most these micro-batches hold activations on the first rank, in stage units::

    gpipe m;  1f1b, zb-h1 min(p, m);  interleaved min(m v, 2(p-1) + (v-1)p + 1) / v chunks,

and on the last (``in_flight_last``): gpipe m; 1f1b 1; zb-h1 min(p, m); interleaved m v / v when
m = p, else min(m v, (v-1)p + 1) / v.

Unequal stages (embedding first, logits last) use the slowest stage for the steady state and the
mean for the fill and drain: ``m * max + (p - 1) * mean`` in the gpipe/1f1b form, and likewise.
Where no closed form applies (zb-h1 with m < p), the schedule is simulated once per
(kind, p, m, v, cost ratios) and cached: a timeline scales linearly with the costs.
"""

from __future__ import annotations

from functools import lru_cache

from mpipar.parallel.pipeline.formulas import makespan
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.simulate import simulate

from .errors import PlanError

SIM_MAX_ACTIONS = 30_000  # compute actions beyond which a fallback simulation is refused


def run_simulation(kind: str, p: int, m: int, v: int, costs: dict):
    """The one call into mpipar's schedule code (its ``virtual`` keyword may be renamed)."""
    return simulate(build_schedule(kind, p, m, v), costs)


@lru_cache(maxsize=4096)
def _simulated_makespan(kind: str, p: int, m: int, v: int, b_ratio: float, w_ratio: float):
    if kind != "zb-h1":
        costs = {"F": 1.0, "BW": b_ratio + w_ratio}
    else:
        costs = {"F": 1.0, "B": b_ratio, "W": w_ratio}
    res = run_simulation(kind, p, m, v, costs)
    return res.makespan, res.peak_activations[0]


def closed_form(kind: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Makespan of equal stages with per-stage costs f, b, w; None where no closed form holds
    exactly in mpipar's simulator (``formulas.makespan``, their one home)."""
    return makespan(kind, p, m, v, f, b, w, strict=True)


def pipeline_time(kind: str, p: int, m: int, v: int, stages: list[tuple[float, float, float]]):
    """(makespan, busy fraction of the mean rank) for per-rank costs (F, B, W) per micro-batch.

    ``stages`` has one (F, B, W) per pipeline rank, summed over its chunks.
    """
    f = sum(s[0] for s in stages) / p
    b = sum(s[1] for s in stages) / p
    w = sum(s[2] for s in stages) / p
    slowest = max(sum(s) for s in stages)
    mean = f + b + w
    t = closed_form(kind, p, m, v, f, b, w)
    if t is None:
        if p * m * v * 3 > SIM_MAX_ACTIONS:
            raise PlanError(
                f"{kind} with p={p}, m={m}: no closed form and too large to simulate; use "
                "m >= p (more micro-batches) or another schedule"
            )
        span, _ = _simulated_makespan(kind, p, m, v, round(b / f, 3), round(w / f, 3))
        t = span * f
    # Unequal stages: the slowest stage sets the steady state (m micro-batches through it).
    t += m * (slowest - mean)
    busy = m * mean
    return t, busy / t


def in_flight(kind: str, p: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first rank holds at its peak, in whole-stage units."""
    if kind == "gpipe":
        return m
    if kind in ("1f1b", "zb-h1"):
        return min(p, m)
    if kind == "interleaved":
        return min(m * v, 2 * (p - 1) + (v - 1) * p + 1) / v
    if kind == "naive":
        return 1
    raise ValueError(f"unknown schedule {kind!r}")


def in_flight_last(kind: str, p: int, m: int, v: int) -> float:
    """The same on the last rank (the one that also holds the logits): GPipe holds all m there
    too, 1F1B one, ZB-H1 min(p, m) (its W waits), interleaved (v - 1) p + 1 chunks once m > p
    (the warm-up of the last rank), all m v when m = p (every forward runs first)."""
    if kind == "gpipe":
        return m
    if kind in ("1f1b", "naive"):
        return 1
    if kind == "zb-h1":
        return min(p, m)
    if kind == "interleaved":
        return (m * v if m <= p else min(m * v, (v - 1) * p + 1)) / v
    raise ValueError(f"unknown schedule {kind!r}")
