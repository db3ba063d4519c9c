"""One configuration's predicted step: pipeline of stage costs, DP all-reduce, optimizer, memory.

Placement (``Config.placement``), tensor-parallel ranks always innermost (within a node):
``tp-pp-dp`` (mpipar's default here) puts pipeline stages next, so a stage boundary crosses nodes
only where a node is full, and a DP group has ``gpus_per_node // (tp*pp)`` members per node (at
least 1) sharing that node's NICs; ``tp-dp-pp`` is Megatron-LM's (``initialize_model_parallel``:
the DP groups inside a block of world/pp consecutive ranks, pipeline groups strided by world/pp),
so stages sit ``tp*dp`` ranks apart and cross nodes once ``tp*dp`` fills one, while a DP group has
``gpus_per_node // tp`` members per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import DTYPES, Cluster
from .costs import (
    GRAD_BYTES,
    activation_bytes,
    embed_params,
    head_costs,
    layer_cost,
    layer_params,
    state_bytes,
)
from .model import GPTShape, layer_gemm_flops, model_flops_per_step
from .pipeline import in_flight, in_flight_last, pipeline_time

GIB = 2**30


@dataclass(frozen=True)
class Config:
    dp: int
    pp: int
    tp: int
    schedule: str
    v: int
    microbatch_size: int
    recompute: str
    sp: bool
    zero1: bool
    # DP gradient reduction overlapping the backward (mpipar's buckets, Megatron-Core's
    # --overlap-grad-reduce); Megatron-LM 2021-22 reduced after the pipeline flush: False.
    dp_overlap: bool = True
    # Megatron's scatter/gather of inter-stage tensors over the TP ranks (SC'21 section 4.1);
    # off only to reproduce the paper's Figure 18 (--no-scatter-gather-tensors-in-pipeline).
    scatter_gather: bool = True
    placement: str = "tp-pp-dp"  # or "tp-dp-pp", Megatron-LM's rank order (module docstring)

    def strides(self) -> tuple[int, int]:
        """(ranks between neighbouring pipeline stages, ranks between DP group members)."""
        if self.placement == "tp-dp-pp":
            return self.tp * self.dp, self.tp
        return self.tp, self.tp * self.pp


def executed_flops(m: GPTShape, batch: int, recompute: str) -> float:
    """FLOPs the GPUs run per step: model FLOPs plus recomputation's forward (full: the layers,
    not the logits, which is Narayanan et al.'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); selective:
    the attention scores and the weighted sum)."""
    flops = model_flops_per_step(m, batch)
    layer = layer_gemm_flops(m, batch)
    if recompute == "full":
        flops += m.layers * sum(layer.values())
    elif recompute == "selective":
        flops += m.layers * (layer["scores"] + layer["values"])
    return flops


def _p2p_time(c: Cluster, m: GPTShape, cfg: Config, e: int, crosses: bool) -> float:
    """One activation (or gradient) transfer between stages. With tp > 1, Megatron's scatter/
    gather: each TP rank sends 1/t over its own link, then an all-gather within the node."""
    nbytes = cfg.microbatch_size * m.seq * m.hidden * e
    t = cfg.tp
    link = c.inter if crosses else c.intra
    if not cfg.scatter_gather:  # every TP rank sends the whole (replicated) tensor over its link
        return link.time(nbytes)
    time = link.time(nbytes / t)
    if t > 1:  # the all-gather of the t pieces runs over NVLink unless tp spans nodes
        gather = c.intra if t <= c.gpus_per_node else c.inter
        time += gather.time((t - 1) / t * nbytes)
    return time


def _stage_costs(m: GPTShape, c: Cluster, peak: float, cfg: Config, dtype: str):
    """Per pipeline rank (F, B, W) per micro-batch, and the TP / p2p seconds inside them."""
    p, b, t, v = cfg.pp, cfg.microbatch_size, cfg.tp, cfg.v
    lc = layer_cost(m, c, peak, b, t, cfg.recompute, cfg.sp, dtype)
    (head_f, head_b), (emb_f, emb_b) = head_costs(m, c, peak, b, t, dtype)
    per_rank = m.layers // p
    per_node = max(1, c.gpus_per_node // cfg.strides()[0])  # stages per node
    e = DTYPES[dtype]
    stages, p2p_total = [], 0.0
    for r in range(p):
        f = per_rank * lc.fwd + (emb_f if r == 0 else 0.0) + (head_f if r == p - 1 else 0.0)
        bi = per_rank * lc.bwd_input + (emb_b if r == 0 else 0.0) + (head_b if r == p - 1 else 0.0)
        w = per_rank * lc.bwd_weight
        if p > 1:  # Megatron's p2p is blocking: each chunk's send sits on the critical path
            crosses = p > per_node and (r + 1) % per_node == 0
            send = _p2p_time(c, m, cfg, e, crosses) * v
            f, bi = f + send, bi + send
            p2p_total = max(p2p_total, 2 * send)
        stages.append((f, bi, w))
    return stages, per_rank * lc.tp_comm, p2p_total


def _dp_time(c: Cluster, cfg: Config, nbytes: float) -> float:
    d = cfg.dp
    if d == 1:
        return 0.0
    stride = cfg.strides()[1]
    if d * stride <= c.gpus_per_node:
        bw, lat = c.intra.bandwidth * c.intra.efficiency, c.intra.latency
    else:  # members of the group on one node share its NICs (one per GPU)
        per_node = max(1, min(d, c.gpus_per_node // stride))
        bw = min(c.intra.bandwidth * c.intra.efficiency,
                 per_node * c.inter.bandwidth * c.inter.efficiency)
        lat = c.inter.latency
    # ZeRO-1: reduce-scatter the gradients, all-gather the weights: the same bytes as all-reduce.
    return lat * (2 if cfg.zero1 else 1) + 2 * (d - 1) / d * nbytes / bw


def _memory(m: GPTShape, c: Cluster, cfg: Config, dtype: str, micro: int) -> tuple[float, float]:
    """(bytes on the busiest GPU, its parameters): the first and last ranks are checked."""
    p, t, b = cfg.pp, cfg.tp, cfg.microbatch_size
    per_rank = m.layers // p
    kept, working = activation_bytes(m, b, t, cfg.recompute, cfg.sp, dtype)
    e = DTYPES[dtype]
    worst, worst_params = 0.0, 0.0
    for r in sorted({0, p - 1}):
        params = per_rank * layer_params(m, t)
        if r == 0:
            params += embed_params(m, t) + m.seq * m.hidden
        if r == p - 1 and (p > 1 or r != 0):
            params += embed_params(m, t)  # the tied output embedding's copy
        # each rank's own peak of live micro-batches (the last rank's was taken as 1: GPipe,
        # ZB-H1 and interleaving hold more there)
        flight = (in_flight if r == 0 else in_flight_last)(cfg.schedule, p, micro, cfg.v)
        acts = per_rank * kept * flight
        if cfg.recompute != "none":
            acts += working  # one layer recomputed in full during the backward
        if r == p - 1:
            acts += b * m.seq * m.vocab / t * (4 + e)  # fp32 logits and their 16-bit copy
        total = state_bytes(params, dtype, cfg.dp, cfg.zero1) + acts + c.workspace
        if total > worst:
            worst, worst_params = total, params
    return worst, worst_params


def evaluate(m: GPTShape, c: Cluster, peak: float, dtype: str, global_batch: int,
             cfg: Config) -> dict:
    """The predicted step of ``cfg`` as a row (the JSON schema of ``mpipar plan``)."""
    micro = global_batch // cfg.dp // cfg.microbatch_size
    stages, tp_comm, p2p = _stage_costs(m, c, peak, cfg, dtype)
    pipe, busy = pipeline_time(cfg.schedule, cfg.pp, micro, cfg.v, stages)
    mem, params = _memory(m, c, cfg, dtype, micro)
    e = DTYPES[dtype]
    dp_total = _dp_time(c, cfg, params * GRAD_BYTES[dtype])
    last_bwd = stages[0][1] + stages[0][2]  # buckets all-reduce while the last backward runs
    dp_exposed = max(0.0, dp_total - (last_bwd if cfg.dp_overlap else 0.0))
    opt_bytes = params * (24 + 2 * e) / (cfg.dp if cfg.zero1 else 1)  # Adam: read+write state
    optimizer = c.hbm_time(opt_bytes)
    step = pipe + dp_exposed + optimizer
    gpus = cfg.dp * cfg.pp * cfg.tp
    hw = executed_flops(m, global_batch, cfg.recompute)
    model = model_flops_per_step(m, global_batch)
    return {
        "dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp, "schedule": cfg.schedule, "v": cfg.v,
        "microbatch_size": cfg.microbatch_size, "microbatches": micro,
        "recompute": cfg.recompute, "sp": cfg.sp, "zero1": cfg.zero1, "dp_overlap": cfg.dp_overlap,
        "placement": cfg.placement,
        "step_time_s": step,
        "tflops_per_gpu": hw / step / gpus / 1e12,
        "model_tflops_per_gpu": model / step / gpus / 1e12,
        "mfu": model / step / gpus / peak,
        "memory_gib": mem / GIB,
        "fits": mem <= c.hbm_capacity,
        "bubble": 1.0 - busy,
        "pipeline_s": pipe, "tp_comm_s": tp_comm * micro, "p2p_s": p2p * micro,
        "dp_allreduce_s": dp_total, "dp_exposed_s": dp_exposed, "optimizer_s": optimizer,
    }
