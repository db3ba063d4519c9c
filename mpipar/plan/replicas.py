"""The wait of data-parallel replicas for the slowest of them, once a step.

A rank's compute per step varies as a whole, from step to step, by the machine (the timing
dumps: each rank's busy time per step varies by 5-13 %, std / mean, on any grid), and dp
replicas run apart until they meet at the gradient reduction, so each step waits for the
slowest: ``E[max of R]``, above the mean a simulation of one replica gives. With the spec's
``step_cv`` (``unit_bench.step_cv``: the reference chain's std / mean over repeats, measured
once) and replicas independent, the step grows by ``e_R x step_cv x`` the busiest pipeline
rank's compute, ``e_R`` the expected largest of ``R`` standard normal draws (0.56 for 2, 1.03
for 4). tp ranks meet in every block, so they move together (the dumps: the slowest tp rank's
busy time per step 1.004 x the mean) and add nothing here.
"""

from __future__ import annotations

import math

from .cluster import Cluster


def expected_max(n: int) -> float:
    """E[max of ``n`` independent standard normal draws] (0 for one), by quadrature of
    x n phi(x) Phi(x)^(n-1) on [-10, 10]."""
    if n <= 1:
        return 0.0
    steps = 4000
    h = 20.0 / steps
    total = 0.0
    for i in range(steps + 1):
        x = -10.0 + i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * phi * cdf ** (n - 1)
    return total * h


def replica_wait(c: Cluster, dp: int, busy: float) -> float:
    """Seconds a step waits for its slowest of ``dp`` replicas, each busy ``busy`` seconds a
    step (module doc); 0 with one replica or no ``step_cv`` in the spec."""
    if dp <= 1 or c.step_cv <= 0:
        return 0.0
    return expected_max(dp) * c.step_cv * busy
