"""The OPT region of a planned step (``plan.here``): gradient norm, clipping and AdamW.

Measured per value and per parameter tensor, cold and warm (``unit_bench.optimizer_costs``);
without those, ``ADAM_TRAFFIC`` values per parameter at the element-wise rate. A rank whose
optimizer state (``opt_state_bytes``: weights, gradients and its share of the two moments)
fits its core's cache (the spec's ``cache_mb``, ``measure.core_cache_bytes``) gets the warm
costs: nothing between two optimizer steps touches enough to evict it (the MLP's 0.6 MB
against 1 MiB), where a larger model's state is gone by then. ``opt_floor``: the region's
fixed cost, from the probe run of ``mpipar plan measure``.
"""

from __future__ import annotations

from .cluster import Cluster

ADAM_TRAFFIC = 12  # values per parameter the optimizer step reads and writes (module doc)


def opt_state_bytes(s: int, values: float, zero: int) -> float:
    """Bytes the OPT region reads on a rank holding ``values`` parameters of ``s`` bytes:
    the weights and gradients, and its ``1 / zero`` share of AdamW's two moments."""
    return s * values * (2 + 2 / zero)


def opt_warm(c: Cluster, s: int, values: float, zero: int = 1) -> bool:
    """Whether a rank's optimizer state stays in its core's cache (module doc): the spec
    knows the cache and has the warm costs, and the state fits."""
    return (c.cache > 0 and "opt_value_warm" in dict(c.units)
            and opt_state_bytes(s, values, zero) <= c.cache)


def _optimizer(c: Cluster, s: int, values: float, tensors: int, warm: bool = False) -> float:
    """The OPT region of a rank holding ``values`` parameter values (its ZeRO-1 share) in
    ``tensors`` tensors: measured per value (``[units] opt_value_us``, fp32, scaled by the
    value size ``s``) when the spec has it, else ADAM_TRAFFIC values per parameter at the
    element-wise rate; plus the measured cost per tensor. ``warm``: the warm costs
    (``opt_value_warm_us``, ``opt_tensor_warm_us``; ``opt_warm`` says when)."""
    units = dict(c.units)
    tag = "_warm" if warm else ""
    per_value = units.get("opt_value" + tag)
    traffic = (per_value * s / 4 * values if per_value is not None
               else c.hbm_time(ADAM_TRAFFIC * s * values))
    return traffic + units.get("opt_tensor" + tag, 0.0) * tensors


def opt_fixed(c: Cluster, s: int, ranks: list[tuple[float, int]]) -> float:
    """Seconds a step's OPT region takes beyond its tensors and values: the probe run's
    measured OPT (``[executor] probe_opt_us``) less what ``_optimizer`` gives the fastest of
    its ranks, each (values, tensors), warm where ``opt_warm`` says so; 0 without the
    probe's number (``here.opt_floor`` counts the probe's ranks)."""
    measured = dict(c.executor).get("probe_opt")
    if measured is None:
        return 0.0
    got = [_optimizer(c, s, n, tensors, opt_warm(c, s, n)) for n, tensors in ranks]
    return max(measured - min(got), 0.0)
