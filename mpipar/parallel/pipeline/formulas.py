"""Published bubble and activation-memory figures of the 2023-2025 schedules, next to the
measures the simulator gives (no MPI here).

Two bubble measures, both with F = B = W = 1 per stage (a chunk costs 1/v of that):

- ``sync``: idle / total over one step with a synchronous optimizer step after the flush, what
  ``simulate().bubble_fraction`` reports and what mpipar runs;
- ``span``: 1 - busy / (the longest span between a rank's first and last compute), the papers'
  measure ("1 - (F+B+W) m / longest stage time", Qi et al. 2024): the idle time that the next
  step could not fill even if it started on each rank as soon as that rank is free (ZB's
  optimizer post-validation). Zero for ZB-H2 and ZB-V: their shapes are parallelograms.

Peak activations are in micro-batches of a whole stage (a V chunk holds half a stage's), the
papers' M_B unit; 1F1B's is pp (on its first rank).

This module is also the one home of the classic schedules' closed forms (``makespan``,
``textbook_bubble``): the simulator's textbook figure (``simulate.textbook_bubble``), the
planner's pipeline timing (``mpipar.plan.pipeline``) and the analysis all read them here.
"""

from __future__ import annotations


def makespan(kind: str, p: int, m: int, v: int, f: float, b: float, w: float, *,
             strict: bool = True) -> float | None:
    """Makespan of a flushed step of equal stages with per-stage, per-micro-batch costs f, b, w
    (BW = b + w); None where no closed form holds.

    ``strict``: only where mpipar's simulator gives exactly this (tests/test_plan.py checks it):
    interleaved needs m a multiple of p, naive m = 1. Otherwise the published form wherever the
    paper states it (interleaved for any m, naive as m micro-batches one after another)::

        gpipe, 1f1b    (m + p - 1) (f + b + w)       Huang et al. 2019; Narayanan et al. 2021
        interleaved    (m + (p - 1)/v) (f + b + w)   Megatron-LM SC'21, sec. 2.2.2
        zb-h1          m (f + b + w) + (p - 1) max(f + b - w, f, b)   (m >= p)
        naive          m p (f + b + w)

    ZB-H1: Qi et al. 2023 (sec. 3.1) give (p - 1)(f + b - w) idle time, which holds while
    w <= min(f, b); the max is what the simulator shows beyond it (a hop costs at least f or b).
    """
    c = f + b + w
    if kind in ("gpipe", "1f1b"):
        return (m + p - 1) * c
    if kind == "interleaved":
        return (m + (p - 1) / v) * c if (m % p == 0 or not strict) else None
    if kind == "zb-h1":
        if p == 1:
            return m * c
        return m * c + (p - 1) * max(f + b - w, f, b) if m >= p else None
    if kind == "naive":
        return p * c if m == 1 else (None if strict else m * p * c)
    return None


def textbook_bubble(kind: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float | None:
    """The published bubble fraction, as idle time / total time (the simulator's normalisation),
    from ``makespan`` with f = b = w = 1: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p-1)
    interleaved, (p-1)/(3m + p-1) ZB-H1 (m >= p), (p-1)/p naive.

    None where no closed form applies: asynchronous PipeDream has no flush, so its bubble
    vanishes in the steady state; ZB-H1 with fewer micro-batches than stages; unknown kinds.
    """
    m = microbatches
    total = makespan(kind, pp, m, virtual_stages, 1.0, 1.0, 1.0, strict=False)
    if total is None:
        return None
    return (total - 3.0 * m) / total


def span_bubble(result) -> float:
    """1 - busy / span of the rank with the longest span (first compute start to last end)."""
    worst = 0.0
    for r, row in enumerate(result.timeline):
        spans = [(a, b) for a, b, act in row if act.is_compute and b > a]
        if not spans:
            continue
        span = spans[-1][1] - spans[0][0]
        worst = max(worst, 1.0 - result.busy[r] / span if span > 0 else 0.0)
    return worst


def peak_stage_activations(result, virtual_stages: int) -> float:
    """The most activations any rank holds, in micro-batches of a whole stage."""
    return max(result.peak_activations) / virtual_stages


def published(kind: str, pp: int, m: int, v: int = 2) -> dict | None:
    """{"sync": bubble, "span": bubble, "peak": stage activations, "exact": bool, "source": str}
    for the new schedules with F = B = W, or None (no closed form). ``exact`` False: the papers
    give the figure only approximately ("~"), which the simulator is compared to loosely."""
    p = pp
    if kind == "zb-h2" and m >= 2 * p - 1:
        # Qi et al. 2023, table 2: bubble (p-1)(T_F + T_B - 2 T_W) = 0, memory (2p-1) M_B; the
        # synchronous step keeps the corners: rank r idles r before and p-1-r after.
        return {"sync": (p - 1) / (3 * m + p - 1), "span": 0.0, "peak": 2 * p - 1,
                "exact": True, "source": "Qi et al. 2023 (ZB-H2), table 2"}
    if kind == "zb-v" and m >= 2 * p - 1:
        # Qi et al. 2023, sec. 6: zero bubble with F = B = W, memory p M_B (1F1B's). With a
        # synchronous step the last rank starts (p-1)/2 late (a chunk is half a stage).
        return {"sync": (p - 1) / (6 * m + p - 1), "span": 0.0, "peak": p,
                "exact": True, "source": "Qi et al. 2023 (ZB-V), sec. 6"}
    if kind == "looped-bfs":
        # Lamy-Poirier 2022: GPipe over v chunks per rank; the bubble of interleaving,
        # (p-1)/(v m + p-1), with every micro-batch's activations held (m M_B).
        return {"sync": (p - 1) / (v * m + p - 1), "span": (p - 1) / (v * m + p - 1),
                "peak": m, "exact": m >= p, "source": "Lamy-Poirier 2022"}
    if kind == "v-half":
        # Qi et al. 2024, table 1: bubble ~ p/(2m), memory (p+2)//2 M_B.
        return {"sync": None, "span": p / (2 * m), "peak": (p + 2) // 2, "exact": False,
                "source": "Qi et al. 2024 (V-Half), table 1"}
    if kind == "v-min":
        # Qi et al. 2024, table 1: bubble ~ 2p/(3m), memory (p+4)//3 M_B.
        return {"sync": None, "span": 2 * p / (3 * m), "peak": (p + 4) // 3, "exact": False,
                "source": "Qi et al. 2024 (V-Min), table 1"}
    if kind == "dualpipev" and m >= 2 * p:
        # DeepSeek DualPipe README: bubble (PP/2-1)(F&B + B - 3W) with PP = 2p chunks, 0 when
        # F&B = F + B and F = B = W; activations PP+1 chunks = p + 1/2 stages (exact here).
        # Run in sequence, a pair waits for the inputs of both halves (its communication is
        # issued together): the synchronous-step bubble is then ZB-H1's, (p-1)/(3m+p-1) (derived
        # here, not published), and the span bubble is not zero.
        return {"sync": (p - 1) / (3 * m + p - 1), "span": 0.0, "peak": p + 0.5,
                "exact": False, "source": "DeepSeek DualPipe README"}
    return None
