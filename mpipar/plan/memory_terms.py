"""Planned peak memory per pipeline rank: the shared memory model plus two terms a dump's own
prediction takes from the dump and a plan must derive.

- **trace**: the timing dump's events held between flushes (``memory_model.trace_bytes``); a
  plan counts the events a rank records per step from the lowered schedule, as the tracer
  records them: one per compute action (F, B, W, BW), one ``LOSS`` per micro-batch on the rank
  holding the last unit, one ``pp.send`` per send, ``pp.recv`` and two ``pp.wait`` per receive,
  each tp all-reduce (``here.unit_costs``' ``tp_calls``: two in each block's F and two in its B,
  the embedding's in F, the head's in B and the loss's three in F), ``dp.allreduce`` and
  ``dp.wait`` per gradient bucket, and four per step (the gradient norm's all-reduce where there
  is more than one rank, ``OPT``, ``STEP``, ``mem.peak``).
- **runtime**: what the MPI runtime, BLAS and the allocator first touch during the steps
  (``memory_model``'s runtime term, ``with_runtime``), per rank: the spec's ``runtime_mb``,
  measured once on the probe run of ``mpipar plan measure`` (its measured peak less this
  model's prediction of it, ``measure.runtime_bytes``).
"""

from __future__ import annotations

import math

from .cluster import Cluster


def trace_events(config: dict, grid: dict, sched, bounds: dict, units: list[dict]) -> list[float]:
    """Events per step each pipeline rank of the lowered schedule ``sched`` records (module
    doc); ``units``: ``here.unit_costs``'s (which carry tp collectives, parameters)."""
    from mpipar.analysis.flops import setting

    tp, dp = int(grid.get("tp", 1)), int(grid.get("dp", 1))
    world = tp * dp * sched.pp
    m = int(setting(config, "microbatches", 1) or 1)
    last = max(bounds, key=lambda c: bounds[c][1])
    full = str(setting(config, "recompute", "none")).lower() in ("full", "true")
    s = 2 if str(setting(config, "dtype", "float32")) in ("bfloat16", "float16") else 4
    s = 8 if str(setting(config, "dtype", "float32")) == "float64" else s
    limit = max(1.0, float(setting(config, "bucket_mb", 4.0)) * 2**20)
    out = []
    for p, actions in enumerate(sched.ranks):
        ops = [a.op for a in actions]
        n = sum(op in ("F", "B", "W", "BW") for op in ops) + 3 + (world > 1)
        n += sum(op.startswith("SEND") for op in ops) + 3 * sum(op.startswith("RECV") for op in ops)
        if sched.rank_of(last) == p:
            n += m
        for chunk, (lo, hi) in bounds.items():
            if sched.rank_of(chunk) != p:
                continue
            if tp > 1:  # each tp all-reduce one event; full recomputation redoes F's
                f_calls = sum(u["tp_calls"][0] for u in units[lo:hi])
                b_calls = sum(u["tp_calls"][1] for u in units[lo:hi])
                n += m * (b_calls + f_calls * (2 if full else 1))
            if dp > 1:
                n += 2 * math.ceil(s * sum(u["params"] for u in units[lo:hi]) / limit)
        out.append(float(n))
    return out


def planned_memory(config: dict, grid: dict, c: Cluster, sched, bounds: dict,
                   units: list[dict]) -> list[dict] | None:
    """``memory_model.predict_run`` with the trace and runtime terms (module doc)."""
    from mpipar.analysis.memory_model import predict_run, with_runtime

    return with_runtime(predict_run(config, grid, trace_events(config, grid, sched, bounds,
                                                                units)), c.runtime)
