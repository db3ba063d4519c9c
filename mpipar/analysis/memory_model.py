"""Bytes each pipeline rank holds at its peak, from the config and the simulated schedule.

Per rank (``p``), with ``P_p`` the parameters of its units (sharded over tp), ``s`` the dtype's
bytes, ``b`` the micro-batch, ``S`` the sequence, ``d`` width, ``H`` heads, ``V`` vocabulary:

- parameters ``s P_p``, gradients ``s P_p``, optimizer state ``k s P_p`` (AdamW k = 2, SGD with
  momentum k = 1, else 0), divided by dp with ZeRO-1;
- activations: the live (micro-batch, chunk) pairs at the simulator's peak (``peak_activations``)
  times what one pair holds. A GPT block holds ``b S (20 d + H S)`` values (as
  ``mpipar.bench.memory``: LN, QKV, attention output, MLP; H S the softmax), the tp-split parts
  divided by tp (sequence parallelism divides the rest too); selective recomputation drops the
  attention core's ``H S`` (+ 2 d of Q/K/V views it rebuilds); full recomputation keeps only each
  chunk's input ``b S d`` (one chunk's whole activations on top, while it is recomputed). The
  head holds ``b S (2 d + V / tp)``; an MLP layer ``b (in + 2 out)``.
- communication buffers: ``RECV_WINDOW`` posted receives per direction plus up to
  ``SEND_BACKLOG`` sends of one boundary activation ``b S d``.
"""

from __future__ import annotations

from .flops import _model, model_kind
from .flops import setting as get

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
RECV_WINDOW, SEND_BACKLOG = 2, 4  # as parallel/pipeline/transfers.py


def _units_gpt(m: dict, tp: int, sp: bool, b: int, seq: int):
    """[(params, activation values per micro-batch)] of embedding, blocks, head."""
    d, V, L = int(m["n_embd"]), int(m["vocab_size"]), int(m["n_layer"])
    H, block = int(m.get("n_head", 1)), int(m.get("block_size", seq))
    tied = bool(m.get("tie_embeddings", False))
    tok = b * seq
    shard = tp if sp else 1  # the replicated parts of a block are split only with SP
    emb = (V * d // tp + block * d, tok * d // shard)
    blk_params = (12 * d * d + 7 * d) // tp + 6 * d
    blk_act = tok * (8 * d // tp + 12 * d // tp + H * seq // tp)  # tp-split: QKV, attn, MLP
    blk_act += tok * 4 * d // shard  # LN inputs/outputs, residuals
    head = ((0 if tied else V * d // tp) + 2 * d, tok * (2 * d // shard + V // tp))
    return [emb] + [(blk_params, blk_act)] * L + [head], tok * d // shard, tok * H * seq // tp


def _units_mlp(m: dict, b: int):
    sizes = [int(x) for x in m.get("sizes", [])]
    units = [(a * o + o, b * (a + 2 * o)) for a, o in zip(sizes[:-1], sizes[1:], strict=True)]
    return units, b * (max(sizes) if sizes else 0), 0


def _units(config: dict, grid: dict):
    kind = model_kind(config)
    m = _model(config)
    tp, dp = int(grid.get("tp", 1)), int(grid.get("dp", 1))
    mb = int(get(config, "microbatches", 1) or 1)
    b = max(int(get(config, "batch_size", 1) or 1) // (mb * dp), 1)
    seq = int(get(config, "seq_len", 1) or get(config, "block_size", 1) or 1)
    try:
        if kind == "gpt":
            return _units_gpt(m, tp, bool(get(config, "sequence_parallel")), b, seq)
        if kind == "mlp":
            return _units_mlp(m, b)
    except (KeyError, TypeError, ValueError):
        pass
    return None


def chunk_bounds(config: dict, grid: dict, virtual_stages: int) -> dict | None:
    """{chunk: (first unit, end unit)} as the trainer cuts the model (``partition``)."""
    from mpipar.parallel.pipeline.partition import chunk_layers

    found = _units(config, grid)
    if found is None:
        return None
    units = found[0]
    method = str(get(config, "partition", "uniform"))
    kw = {"method": method}
    if method in ("params", "cost"):
        kw["weights"] = [u[0] * int(grid.get("tp", 1)) + 1 for u in units]
    if method == "explicit":
        kw["boundaries"] = list(get(config, "boundaries", []))
    return chunk_layers(len(units), int(grid["pp"]), virtual_stages, **kw)


def rank_memory(config: dict, grid: dict, schedule, peak_activations, bounds) -> list[dict] | None:
    """Predicted bytes per pipeline rank: params, grads, optimizer, activations, buffers, total.

    ``bounds``: {chunk: (first unit, end unit)}. None when the model kind is unknown.
    """
    found = _units(config, grid)
    if found is None or bounds is None:
        return None
    units, boundary, core = found
    kind = model_kind(config)
    dp = int(grid.get("dp", 1))
    s = DTYPE_BYTES.get(str(get(config, "dtype", "float32")), 4)
    recompute = str(get(config, "recompute", "none")).lower()
    recompute = {"true": "full", "false": "none"}.get(recompute, recompute)
    opt = str(get(config, "optimizer", "adamw"))
    k = 2 if opt == "adamw" else (1 if float(get(config, "momentum", 0) or 0) else 0)
    zero = dp if get(config, "zero1") else 1
    out = []
    for p, actions in enumerate(schedule.ranks):
        chunks = sorted({a.chunk for a in actions} | {c for c in bounds if c % schedule.pp == p})
        held = [units[i] for c in chunks for i in range(*bounds[c])]
        n = sum(u[0] for u in held)
        per_pair = [sum(units[i][1] for i in range(*bounds[c])) for c in chunks]
        blocks = [sum(1 for i in range(*bounds[c]) if 0 < i < len(units) - 1) for c in chunks]
        avg = sum(per_pair) / len(per_pair) if per_pair else 0
        live = peak_activations[p] if p < len(peak_activations) else 0
        if recompute == "full":
            act = live * boundary + max(per_pair, default=0)
        elif recompute == "selective" and kind == "gpt":
            avg_core = core * sum(blocks) / max(len(blocks), 1)
            act = live * (avg - avg_core)
        else:
            act = live * avg
        row = {"params": s * n, "grads": s * n, "optimizer": k * s * n // zero,
               "activations": int(s * act),
               "buffers": s * boundary * (2 * RECV_WINDOW + SEND_BACKLOG) if schedule.pp > 1
               else 0}
        row["total"] = sum(row.values())
        out.append(row)
    return out
