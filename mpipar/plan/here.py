"""A run planned from a cluster spec alone: the calibrated path's model, the spec's costs.

``mpipar.analysis.predict`` fits a ``CostModel`` from a dump and simulates the run's lowered
schedule; this module fills the same ``CostModel`` from the configuration's FLOPs and bytes and
a cluster spec (``mpipar plan measure`` writes one of this machine), and runs the same simulator
and the same outcome arithmetic (``predict.expected_outcomes``, ``pipeline_bubble``) and the same
memory model (``memory_model.predict_run``). So a planned and a calibrated column differ only
in where the costs came from.

Costs, per micro-batch of ``T`` tokens (GPT; samples for the MLP), ``s`` bytes per value, on one
tensor-parallel rank (1D Megatron cut, ``models.counts``):

- forward of a unit: each GEMM's FLOPs / (peak x ``Cluster.gemm_efficiency`` at its smallest
  dimension: tokens, its output width on this rank, or the head dimension for the attention
  core), plus element-wise traffic (the values the unit keeps for the backward and its
  transient buffers, written and read once: ``2 s T (stored + work)`` / the element-wise rate),
  plus two tensor-parallel all-reduces of ``T d`` values per block (collective link);
- the MLP's loss (its own LOSS region, in no unit): the measured per-call floor
  (``[units] floor_loss_f_us`` / ``floor_loss_b_us``) added to its last unit's F and B (the
  GPT's loss is in the head's measured times);
- what a unit's phase costs from these (``plan.unit_fit``): the measured floor plus the GEMM
  time plus ``k`` times the element-wise time, ``k`` what makes the reference shape come out
  as measured (``[units]``); with ``with_shapes``, the GEMM, attention-core GEMM and
  element-wise times weighed by the fit over the spec's other GPT shapes (beside the plan);
- backward: input gradients (the forward's GEMM time again, twice its traffic, its two
  all-reduces) and weight gradients (the GEMM time again); ``full`` recomputation adds the
  whole forward to B, ``selective`` the attention core's GEMM time and traffic;
- p2p: the spec's p2p latency and bandwidth, the boundary activation's bytes; per-action
  overhead, send/receive posting and fixed per-step costs: the spec's ``[executor]`` section
  (zero when a bundled spec has none); the gradient-norm all-reduce: the collective latency;
- the executor's work inside a compute event beyond its units' own calls (fetching the input,
  the pools, the trace): ``action_floor``, the probe run's measured mean F and backward per
  chunk (``[executor] probe_f_us`` / ``probe_b_us``, ``measure.PROBE``) less what this model
  gives that run without it; added to every chunk's F and B (backward-input, or the fused BW);
- core sharing (CPU specs, ``cores_per_node``; ``plan.sharing``): a node running more ranks than
  it has cores gives each rank cores / ranks of one (MPI waits poll, so an idle rank still holds
  its core), over the spec's measured ``shared_slowdown`` (``plan.oversub``): every CPU cost
  (units, optimizer, executor) is divided by that share; links are not. A collective's wait for
  a partner that is off its core is that partner's share being given to another rank, already
  counted by the division: no wait on top (the dumps of 4 ranks on 2 cores: a tp rank's own
  compute per step is 0.9-1.3 x its compute on a core of its own, its tp calls hold the rest,
  where a rank without tp computes 2.0-2.8 x as long); the wait of half a scheduler slice per
  call (``cosched_wait``) is shown beside, not added;
- tp all-reduces: two in each block's F and two in its B (``T d`` values), and, from the
  vocab-parallel embedding and head, one in the embedding's F, one in the head's B (its input
  gradient) and the loss's three of ``T`` values in the head's F (max, sum of exps, target);
- dp replicas (``plan.replicas``): one replica is simulated; the step adds the wait for the
  slowest of the ``dp`` replicas, from the spec's ``step_cv`` (``replica_wait``);
- dp: each chunk's gradients all-reduced in ``bucket_mb`` buckets (latency per bucket, ring
  volume 2 (dp-1)/dp bytes / bus bandwidth); optimizer: AdamW's ~12 values of traffic per
  parameter (weights, gradient, two moments read and written, the update and clipping) / the
  element-wise rate, or, in a measured spec, the OPT region's measured cost per value
  (``[units] opt_value_us``: norm, clipping and AdamW, ``unit_bench.optimizer_costs``), split
  by dp under ZeRO-1, plus its measured cost per parameter tensor (``opt_tensor_us``) times
  the rank's tensors, plus the region's fixed cost (``opt_floor``: the probe run's measured
  OPT, ``[executor] probe_opt_us``, less what the two terms give it: the norm and loss
  all-reduce's call, the learning rate, the step's bookkeeping). Both costs are measured cold
  and warm (``unit_bench.optimizer_costs``); a rank whose optimizer state (``opt_state_bytes``:
  weights, gradients and its share of the two moments) fits its core's cache (the spec's
  ``cache_mb``) gets the warm ones: nothing between two optimizer steps touches enough to
  evict it (the MLP's 0.6 MB against 1 MiB), where a larger model's state is gone by then.
"""

from __future__ import annotations

import math

from . import unit_fit
from .cluster import Cluster
from .errors import PlanError
from .memory_terms import planned_memory
from .opt_region import _optimizer, opt_fixed, opt_warm
from .placement import axis_links
from .replicas import replica_wait
from .sharing import core_share, cosched_wait
from .unit_fit import one_shape, phase_times

DTYPE_KEYS = {"float32": ("fp32", 4), "float64": ("fp64", 8), "bfloat16": ("bf16", 2),
              "float16": ("fp16", 2)}


def _get(config, key, default=None):
    from mpipar.analysis.flops import setting

    return setting(config, key, default)


def _peak(cluster: Cluster, config: dict) -> tuple[float, int]:
    dtype = str(_get(config, "dtype", "float32"))
    key, s = DTYPE_KEYS.get(dtype, ("fp32", 4))
    peak = cluster.peak.get(key) or cluster.peak.get("fp32")
    if not peak:
        raise PlanError(f"cluster {cluster.name} gives no peak for {key}; it has "
                        f"{', '.join(cluster.peak)} (measure one: mpipar plan measure)")
    return peak, s


def _allreduce(link, nbytes: float, n: int) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return link.latency + 2 * (n - 1) / n * nbytes / (link.bandwidth * link.efficiency)


def _gemm(c: Cluster, peak: float, flops: float, smallest: float) -> float:
    return flops / (peak * c.gemm_efficiency(max(smallest, 1.0))) if flops else 0.0


def unit_costs(config: dict, grid: dict, c: Cluster, links: dict | None = None,
               outside_tp: bool = True) -> list[dict]:
    """Per model unit, one micro-batch on one tp rank: {gemm, core_gemm, mem, core_mem, tp_f,
    tp_b, tp_calls, params} in seconds (``params`` in values), as the module doc counts them.
    ``links``: ``placement.axis_links``'s, default every rank on one node; ``outside_tp``
    False: the blocks' tp all-reduces only (not the embedding's, the head's, the loss's)."""
    from mpipar.analysis.flops import model_kind, model_section
    from mpipar.analysis.memory_model import split_of

    peak, s = _peak(c, config)
    tp, dp = int(grid.get("tp", 1)), int(grid.get("dp", 1))
    mb = int(_get(config, "microbatches", 1) or 1)
    b = max(int(_get(config, "batch_size", 1) or 1) // (mb * dp), 1)
    m = model_section(config)
    coll = links["tp"] if links else c.collective or c.intra
    if model_kind(config) == "mlp":
        sizes = [int(x) for x in m.get("sizes", [])]
        return [{"kind": "linear", "gemm": _gemm(c, peak, 2 * a * o * b, min(b, a, o)),
                 "core_gemm": 0.0,
                 "mem": c.hbm_time(2 * s * b * (a + 3 * o)), "core_mem": 0.0, **NO_TP,
                 "params": a * o + o, "tensors": 2, "loss": i == len(sizes) - 2}
                for i, (a, o) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))]
    if model_kind(config) != "gpt":
        raise PlanError("planned costs need a GPT or an MLP config (model.kind)")
    from mpipar.models.counts import block_flops, gpt_counts
    from mpipar.models.spec import GPTDims, gpt_units

    seq = int(_get(config, "seq_len", 0) or m.get("block_size"))
    dims = GPTDims.of({"block_size": seq, **m})
    split = split_of(config, grid)
    T, d, heads = b * seq, dims.n_embd, dims.n_head
    parts = block_flops(dims, seq)
    out = []
    # embedding, blocks, head; counted without selective recomputation whatever the run does:
    # the forward computes and writes the attention probabilities either way (selective only
    # frees them after it, the memory model's business), so its traffic is the same; the
    # recomputation's own cost is added to B (``unit_fit.phase_times``). Counted with it, the
    # 8-block GPT's F came out 3.6 % longer and the recomputation about twice what its dumps
    # show (B +0.23-0.34 ms per block and micro-batch, F unchanged)
    counts = gpt_counts(dims, split, seq)
    for i, (u, unit) in enumerate(zip(counts, gpt_units(dims), strict=True)):
        kind = "embed" if i == 0 else ("head" if i == len(counts) - 1 else "block")
        row = {"kind": kind, "gemm": 0.0, "core_gemm": 0.0, "core_mem": 0.0, **NO_TP,
               "params": u.params, "tensors": _tensors(unit),
               # the attention probabilities (``u.core``) are the core's, counted apart
               "mem": c.hbm_time(2 * s * T * (u.stored - u.core + u.work) + u.id_bytes * T)}
        if kind == "head":  # the head: the logits GEMM (its loss is element-wise)
            row["gemm"] = _gemm(c, peak, u.flops * T / tp, min(T, dims.vocab_size / tp))
        elif u.flops:
            core = parts.get("attn.core", 0)
            row["gemm"] = _gemm(c, peak, (u.flops - core) * T / tp, min(T, d / tp))
            row["core_gemm"] = _gemm(c, peak, core * T / tp, d / heads)
            row["core_mem"] = c.hbm_time(2 * s * T * u.core)
            row |= _tp_calls(coll, s, T, d, tp, (2, 2))
        if kind != "block" and outside_tp:  # the vocab-parallel embedding and head
            row |= _tp_calls(coll, s, T, d, tp, (1, 0) if kind == "embed" else (0, 1),
                             loss=kind == "head")
        out.append(row)
    return out


NO_TP = {"tp_f": 0.0, "tp_b": 0.0, "tp_calls": (0, 0)}
LOSS_REDUCES = 3  # the vocab-parallel loss: the logits' max, the sum of exps, the target logit


def _tp_calls(coll, s: int, T: int, d: int, tp: int, calls: tuple, loss: bool = False) -> dict:
    """{tp_f, tp_b, tp_calls}: a unit's tp all-reduces of ``T d`` values, ``calls`` (in F,
    in B), plus with ``loss`` the loss's three of ``T`` values in F; none on one tp rank."""
    if tp <= 1:
        return dict(NO_TP)
    big, small = _allreduce(coll, s * T * d, tp), _allreduce(coll, s * T, tp)
    extra = LOSS_REDUCES if loss else 0
    return {"tp_f": calls[0] * big + extra * small, "tp_b": calls[1] * big,
            "tp_calls": (calls[0] + extra, calls[1])}


def _tensors(unit) -> int:
    """Parameter tensors of a GPT unit (``models.spec``): a linear's weight (none when tied to
    the embedding) and bias, a norm's two, an embedding table."""
    from mpipar.models import spec

    n = 0
    for part in unit.leaves():
        if isinstance(part, spec.Linear):
            n += (0 if part.tied else 1) + (1 if part.bias else 0)
        elif isinstance(part, spec.Norm):
            n += 2
        elif isinstance(part, (spec.TokenEmbedding, spec.PositionEmbedding)):
            n += 1
    return n


def calibration(c: Cluster) -> dict:
    """``unit_fit.calibration`` of the spec ``c`` with this module's unit counts."""
    return unit_fit.calibration(c, unit_costs)


def action_floor(c: Cluster) -> tuple[float, float]:
    """(F, backward) seconds the executor adds inside each compute event (module doc); (0, 0)
    without the probe's numbers."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower

    from .measure import PROBE

    ex = dict(c.executor)
    if "probe_f" not in ex or "probe_b" not in ex:
        return 0.0, 0.0
    sched = lower(build_schedule("1f1b", 2, 4, virtual_stages=1))
    model = cost_model(PROBE, {"dp": 1, "pp": 2, "tp": 1}, c, sched, 1, 2, floor=(0.0, 0.0))
    fwd = [t for (_, _, op), t in model.per_unit.items() if op == "F"]
    bwd = [t for (_, _, op), t in model.per_unit.items() if op == "BW"]
    return (max(ex["probe_f"] - sum(fwd) / len(fwd), 0.0),
            max(ex["probe_b"] - sum(bwd) / len(bwd), 0.0))


def cost_model(config: dict, grid: dict, c: Cluster, sched, v: int,  # noqa: C901
               ranks_per_node: int | None = None, floor: tuple | None = None,
               share: bool = True, cosched: bool = False, warm: bool = True,
               outside_tp: bool = True, slowdown: bool = True):
    """The ``CostModel`` of the run's lowered schedule ``sched``, from the spec (module doc).
    ``ranks_per_node``: default every rank of the run on one node (else the axes whose groups
    span nodes cost on ``[inter_node]``, ``placement.axis_links``); ``floor``: the executor's
    (F, backward) in-event floor, default ``action_floor``; ``share`` False: without the
    terms of ranks sharing cores (``plan.sharing``), ``cosched`` True: each collective call
    also waits ``cosched_wait`` (shown beside the plan, not in it: module doc);
    ``warm`` False: every rank's OPT region at its cold costs (``opt_warm``); ``outside_tp``
    False: the blocks' tp all-reduces only (``unit_costs``); ``slowdown`` False: the share
    without the spec's ``shared_slowdown`` (``plan.oversub``)."""
    from mpipar.analysis.memory_model import chunk_bounds
    from mpipar.models.counts import boundary_values
    from mpipar.parallel.pipeline.simulate import CostModel

    # which axes cross nodes (ranks_per_node, parallel.order): their links (``placement``)
    links = axis_links(c, grid, ranks_per_node, grid.get("order") or _get(config, "order"))
    units = unit_costs(config, grid, c, links, outside_tp)
    dp, tp = int(grid.get("dp", 1)), int(grid.get("tp", 1))
    world = dp * sched.pp * tp
    node = ranks_per_node or world
    wait = (lambda g: cosched_wait(c, node, g)) if share and cosched else (lambda g: 0.0)
    cal = calibration(c)
    bounds = chunk_bounds(config, grid, v)
    if bounds is None:
        raise PlanError("planned costs need the model's stage bounds (model.kind gpt or mlp)")
    _, s = _peak(c, config)
    recompute = str(_get(config, "recompute", "none")).lower()
    recompute = {"true": "full", "false": "none"}.get(recompute, recompute)  # older configs
    zero = dp if _get(config, "zero1") and dp > 1 else 1
    ex = dict(c.executor)
    coll = links["dp"]
    bucket = max(1.0, float(_get(config, "bucket_mb", 4.0)) * 2**20)
    model = CostModel(unit={})
    params, tensors, spins = {}, {}, {}
    floor_f, floor_b = action_floor(c) if floor is None else floor
    for chunk, (lo, hi) in bounds.items():
        p = sched.rank_of(chunk)
        fwd, bwd_in, wgt = (sum(x) for x in zip(*(phase_times(u, cal, recompute)
                                                   for u in units[lo:hi]), strict=True))
        us = units[lo:hi]
        fwd, bwd_in = fwd + floor_f, bwd_in + floor_b
        for op, val in (("F", fwd), ("B", bwd_in), ("W", wgt), ("BW", bwd_in + wgt)):
            model.per_unit[(p, chunk, op)] = val
        # with ``cosched``, each tp all-reduce (2 more per block when B redoes F) spins for its
        # partners: added after the time sharing below (a spin is wall time, not work)
        f_calls = sum(u["tp_calls"][0] for u in us)
        b_calls = sum(u["tp_calls"][1] for u in us) + (f_calls if recompute == "full" else 0)
        spins[(p, chunk)] = (f_calls * wait(tp), b_calls * wait(tp))
        n = sum(u["params"] for u in us)
        params[p] = params.get(p, 0.0) + n
        tensors[p] = tensors.get(p, 0) + sum(u["tensors"] for u in us)
        if dp > 1:
            nbytes = s * n
            model.dp_reduce[(p, chunk)] = (math.ceil(nbytes / bucket) * (coll.latency + wait(dp))
                                           + _allreduce(coll, nbytes, dp) - coll.latency)
    fixed = opt_floor(c)
    model.optimizer = {p: _optimizer(c, s, n / zero, tensors[p],
                                     warm and opt_warm(c, s, n, zero)) + fixed
                       for p, n in params.items()}
    pp_link = links["pp"]
    model.latency, model.bandwidth = pp_link.latency, pp_link.bandwidth * pp_link.efficiency
    model.default_bytes = s * _boundary(config, grid, boundary_values)
    model.overhead = ex.get("action_overhead", 0.0)
    model.send_post, model.recv_post = ex.get("send_post", 0.0), ex.get("recv_post", 0.0)
    # the gradient-norm all-reduce
    model.sync = links["world"].latency + wait(world) if world > 1 else 0.0
    model.step_pre, model.step_post = ex.get("step_pre", 0.0), ex.get("step_post", 0.0)
    frac = core_share(c, node, slowdown) if share else 1.0
    if frac < 1:
        model.per_unit = {k: t / frac for k, t in model.per_unit.items()}
        model.optimizer = {k: t / frac for k, t in model.optimizer.items()}
        for name in ("overhead", "send_post", "recv_post", "step_pre", "step_post"):
            setattr(model, name, getattr(model, name) / frac)
    for (p, chunk), (f_spin, b_spin) in spins.items():
        for op, extra in (("F", f_spin), ("B", b_spin), ("BW", b_spin)):
            model.per_unit[(p, chunk, op)] += extra
    return model.check()


def opt_floor(c: Cluster) -> float:
    """The OPT region's fixed cost (``opt_region.opt_fixed``) from the probe run's ranks
    (``measure.PROBE``: their parameter values and tensors)."""
    from mpipar.analysis.memory_model import chunk_bounds

    from .measure import PROBE

    grid = {"dp": 1, "pp": 2, "tp": 1}
    units, (_, s) = unit_costs(PROBE, grid, c), _peak(c, PROBE)
    return opt_fixed(c, s, [(sum(u["params"] for u in units[lo:hi]),
                             sum(u["tensors"] for u in units[lo:hi]))
                            for lo, hi in chunk_bounds(PROBE, grid, 1).values()])


def _boundary(config, grid, boundary_values) -> float:
    """Values of the activation one micro-batch sends between stages."""
    from mpipar.analysis.flops import model_kind, model_section
    from mpipar.analysis.memory_model import split_of
    from mpipar.models.spec import GPTDims

    m = model_section(config)
    dp = int(grid.get("dp", 1))
    mb = int(_get(config, "microbatches", 1) or 1)
    b = max(int(_get(config, "batch_size", 1) or 1) // (mb * dp), 1)
    if model_kind(config) == "mlp":
        return b * max(int(x) for x in m.get("sizes", [1]))
    seq = int(_get(config, "seq_len", 0) or m.get("block_size"))
    dims = GPTDims.of({"block_size": seq, **m})
    return b * seq * boundary_values(dims, split_of(config, grid))


def planned(config: dict, grid: dict, cluster: Cluster, ranks_per_node: int | None = None,
            with_floor: bool = True, with_share: bool = True, with_cosched: bool = False,
            with_warm: bool = True, with_replicas: bool = True,
            with_outside_tp: bool = True, with_slowdown: bool = True,
            with_shapes: bool = False) -> dict:
    """{step, bubble, bubble_step, compute[p], comm[p], overhead[p], memory[p] | None,
    memory_parts} of the run ``config`` on ``grid`` (dp, pp, tp), from the spec alone
    (``ranks_per_node``: default all ranks on one node; ``with_floor`` False: without the
    executor's in-event floor, ``action_floor``; ``with_share`` False: without the terms of
    ranks sharing cores, ``plan.sharing``; ``with_cosched`` True: each collective also
    waits half a slice for partners off their cores, ``cosched_wait``, not in the plan;
    ``with_warm`` False: the OPT region cold on every rank, ``opt_warm``; ``with_replicas``
    False: without the dp replicas' wait for the slowest, ``plan.replicas``;
    ``with_outside_tp`` False: the blocks' tp all-reduces only, ``unit_costs``;
    ``with_slowdown`` False: ranks sharing cores at their bare share, ``plan.oversub``;
    ``with_shapes`` True: the units' parts weighed by the fit over the spec's GPT shapes,
    ``unit_fit``; default the reference shape alone: shown beside the plan, not in it)."""
    from mpipar.analysis.memory_model import chunk_bounds
    from mpipar.analysis.predict import expected_outcomes
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower

    kind = str(_get(config, "schedule", "1f1b") or "1f1b")
    pp = int(grid.get("pp", 1))
    m = int(_get(config, "microbatches", 1) or 1)
    v = int(_get(config, "virtual_stages", 1) or 1)
    if _get(config, "continuous", False):
        raise PlanError("planned: a continuous (no flush) run is not planned; the calibrated "
                        "column covers it")
    sched = lower(build_schedule(kind, pp, m, virtual_stages=v))
    if not with_shapes:
        cluster = one_shape(cluster)
    model = cost_model(config, grid, cluster, sched, v, ranks_per_node,
                       None if with_floor else (0.0, 0.0), with_share, with_cosched,
                       with_warm, with_outside_tp, with_slowdown)
    out = expected_outcomes(sched, [[model]], [0])[0]
    # one replica simulated: the step's wait for the slowest of the dp replicas on top
    out["replica_wait"] = (replica_wait(cluster, int(grid.get("dp", 1)), max(out["compute"]))
                           if with_replicas else 0.0)
    out["step"] += out["replica_wait"]
    mem = planned_memory(config, grid, cluster, sched, chunk_bounds(config, grid, v),
                         unit_costs(config, grid, cluster))
    out["memory"] = [r["total"] for r in mem] if mem else None
    out["memory_parts"] = mem
    out["spec"] = cluster.name
    return out


SPEC_ENV = "MPIPAR_SPEC"  # a spec of this machine (``mpipar plan measure --out FILE``)


def attach_planned(runs, results, spec: str | None) -> None:
    """Put ``planned`` (or ``planned_note``, why not) in each result's summary, for the
    planned column of ``mpipar analyze``. ``spec``: a spec file or bundled name, else the
    file ``$MPIPAR_SPEC`` names; neither: a note saying how to make one."""
    import os

    from .cluster import load_cluster

    spec = spec or os.environ.get(SPEC_ENV)
    if not spec:
        for res in results:
            res["summary"]["planned_note"] = ("planned: no machine spec (mpipar plan measure "
                                              "--out here.toml, then --spec here.toml or "
                                              f"${SPEC_ENV})")
        return
    cluster = load_cluster(spec)  # a bad spec: one PlanError for the command to print
    for run, res in zip(runs, results, strict=True):
        try:
            res["summary"]["planned"] = planned(run.config, run.grid, cluster)
        except (PlanError, KeyError, ValueError, TypeError) as exc:
            res["summary"]["planned_note"] = f"planned: not available ({exc})"
