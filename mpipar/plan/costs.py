"""Time of one micro-batch through one layer on one GPU, and the bytes a GPU holds.

Conventions: s sequence, b micro-batch size, h hidden, a heads, V vocabulary, t tensor-parallel
size, e bytes per element of the training dtype. Every time here is per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.counts import block_counts, part_params
from ..models.spec import gpt_embed
from ..parallel.tp_split import TPSplit
from .cluster import DTYPES, Cluster
from .model import GPTShape, layer_gemm_flops, logits_flops

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerCost:
    fwd: float  # forward of one layer, one micro-batch (compute + memory-bound + TP collectives)
    bwd_input: float  # input-gradient part of the backward (B), recomputation included
    bwd_weight: float  # weight-gradient GEMMs (W)
    tp_comm: float  # TP collective time inside fwd + bwd_input (reported apart)


def gemm_times(m: GPTShape, c: Cluster, peak: float, b: int, t: int) -> dict[str, float]:
    """Forward time of each GEMM of a layer: FLOPs / t over the peak times the achievable
    efficiency at that GEMM's smallest dimension on one GPU (Megatron splits columns then rows),
    times the wave quantization of its output (``Cluster.wave_efficiency``: M x N tiles on the
    SMs). The backward's GEMMs (same FLOPs, transposed outputs) are costed at the forward's."""
    s, h, a = m.seq, m.hidden, m.heads
    flops = layer_gemm_flops(m, b)
    rows, heads = b * s, b * a // t
    smallest = {
        "qkv": min(rows, 3 * h // t, h),
        "scores": min(s, h // a),  # batched over b*a/t heads: s x s x (h/a)
        "values": min(s, h // a),  # s x (h/a) x s
        "proj": min(rows, h, h // t),
        "mlp": min(rows, h, 4 * h // t),  # h->4h/t and 4h/t->h: the same smallest side
    }
    waves = {
        "qkv": c.wave_efficiency(rows, 3 * h // t),
        "scores": c.wave_efficiency(s, s, heads),
        "values": c.wave_efficiency(s, h // a, heads),
        "proj": c.wave_efficiency(rows, h),  # row-parallel: the full h columns out
        "mlp": (c.wave_efficiency(rows, 4 * h // t) + c.wave_efficiency(rows, h)) / 2,
    }
    return {k: flops[k] / t / (peak * c.gemm_efficiency(smallest[k]) * waves[k]) for k in flops}


def elementwise_bytes(m: GPTShape, b: int, t: int, sp: bool, e: int) -> tuple[float, float]:
    """HBM bytes of a layer's memory-bound forward work: (outside attention core, attention core).

    LayerNorm x2 (read, write), bias-dropout-residual x2 (read 2, write 1, 1-byte mask) on b*s*h
    elements, replicated on each TP rank unless sequence-parallel; GeLU on the 4h MLP activation
    (read, write) split by t; softmax (read, write) and dropout (read, write, mask) on the
    b*a*s*s attention scores, split by t. The backward moves about twice these bytes.
    """
    s, h, a = m.seq, m.hidden, m.heads
    bsh = b * s * h
    rep = bsh / t if sp else bsh
    outside = 2 * (2 * e) * rep + 2 * (3 * e + 1) * rep + 2 * e * 4 * bsh / t
    core = (4 * e + 1) * b * a * s * s / t
    return outside, core


def allreduce_time(c: Cluster, nbytes: float, t: int) -> float:
    """Ring all-reduce over t GPUs (also = reduce-scatter + all-gather with SP): within a node
    over NVLink; a group wider than a node (SC'21 Figures 13 and 15 ran tp 16 and 32) rings
    through each GPU's own NIC, the slowest link on the ring."""
    if t == 1:
        return 0.0
    link = c.intra if t <= c.gpus_per_node else c.inter
    return link.latency + 2 * (t - 1) / t * nbytes / (link.bandwidth * link.efficiency)


def layer_cost(m: GPTShape, c: Cluster, peak: float, b: int, t: int, recompute: str, sp: bool,
               dtype: str) -> LayerCost:
    e = DTYPES[dtype]
    g = gemm_times(m, c, peak, b, t)
    linear = g["qkv"] + g["proj"] + g["mlp"]
    core_gemm = g["scores"] + g["values"]
    outside, core = elementwise_bytes(m, b, t, sp, e)
    mem_out, mem_core = c.hbm_time(outside), c.hbm_time(core)
    # 2 all-reduces forward, 2 backward (Megatron); with SP, all-gather + reduce-scatter in their
    # place: the same bytes, twice the latency.
    ar = allreduce_time(c, b * m.seq * m.hidden * e, t)
    if sp and t > 1:
        ar += c.intra.latency
    fwd = linear + core_gemm + mem_out + mem_core + 2 * ar
    extra = 0.0  # forward work redone in the backward
    if recompute == "full":
        extra = fwd
    elif recompute == "selective":  # attention core only (Korthikanti et al. 2022)
        extra = core_gemm + mem_core
    bwd_input = linear + 2 * core_gemm + 2 * (mem_out + mem_core) + 2 * ar + extra
    tp = (4 + (2 if recompute == "full" else 0)) * ar
    return LayerCost(fwd=fwd, bwd_input=bwd_input, bwd_weight=linear, tp_comm=tp)


def head_costs(m: GPTShape, c: Cluster, peak: float, b: int, t: int, dtype: str):
    """(forward, backward) of the logits layer with its fp32 cross-entropy (last stage), and of
    the embedding gather plus position add (first stage); vocabulary split over t."""
    e = DTYPES[dtype]
    s, h = m.seq, m.hidden
    eff = c.gemm_efficiency(min(b * s, m.vocab // t, h))
    logits = logits_flops(m, b) / t / (peak * eff)
    loss = c.hbm_time(3 * 4 * b * s * m.vocab / t)  # fp32 logits: softmax, loss, gradient
    embed = c.hbm_time(3 * e * b * s * h)
    return (logits + loss, 2 * logits + loss), (embed, 2 * embed)


def activation_bytes(m: GPTShape, b: int, t: int, recompute: str, sp: bool, dtype: str):
    """Activations one layer keeps per micro-batch (Korthikanti et al. 2022, table 2, 16-bit):
    sbh(10 + 24/t + 5as/(ht)); with SP sbh(34/t + 5as/(ht)); selective recompute drops the 5as/h
    term; full recompute keeps only the layer input, 2sbh (split by t with SP)."""
    s, h, a = m.seq, m.hidden, m.heads
    sbh = s * b * h
    scale = DTYPES[dtype] / 2
    attn = 5 * a * s / (h * t)
    base = 34 / t if sp else 10 + 24 / t
    if recompute == "none":
        per = sbh * (base + attn)
    elif recompute == "selective":
        per = sbh * base
    else:
        per = 2 * sbh / (t if sp else 1)
    return per * scale, sbh * (base + attn) * scale  # (kept, one layer's full working set)


def layer_params(m: GPTShape, t: int) -> float:
    """Weights of one layer on one TP rank (``models.counts``, Megatron's 1D cut): 12 h^2 / t
    and the column biases split, the row biases and LayerNorms (6 h) whole."""
    return block_counts(m.dims(), TPSplit.of("1d", t), m.seq).params


def embed_params(m: GPTShape, t: int) -> float:
    """Vocabulary-parallel word embedding on one TP rank (a tied copy sits on the last stage)."""
    return part_params(gpt_embed(m.dims()).parts[0], TPSplit.of("1d", t))


# Bytes per parameter of Megatron-LM's mixed-precision Adam, as its distributed-optimizer docs
# tabulate them (docs/source/distrib_optimizer.md: "fp16 param, fp16 grads 20 | 4 + 16/d; bf16
# param, fp32 grads 18 | 6 + 12/d; fp32 param, fp32 grads 16 | 8 + 8/d"), split into (kept whole
# on every DP rank, divided by dp under ZeRO-1 / --use-distributed-optimizer):
#   fp16: fp16 weights 2 + fp16 grads 2 | fp32 grad copy 4 + fp32 master 4 + Adam m 4 + v 4 = 20
#   bf16: bf16 weights 2 + fp32 main_grad 4 (grads accumulate and all-reduce in fp32) | 12 = 18
#   fp32: weights 4 + grads 4 | Adam m 4 + v 4 = 16
STATE_BYTES = {"fp16": (4.0, 16.0), "bf16": (6.0, 12.0), "fp32": (8.0, 8.0)}
# Bytes per parameter the data-parallel gradient reduction moves (the grad dtype above).
GRAD_BYTES = {"fp16": 2, "bf16": 4, "fp32": 4}


def state_bytes(params: float, dtype: str, dp: int, zero1: bool) -> float:
    """Weights, gradients and optimizer state of ``params`` on one GPU (STATE_BYTES)."""
    whole, sharded = STATE_BYTES[dtype]
    return params * (whole + sharded / (dp if zero1 else 1))
