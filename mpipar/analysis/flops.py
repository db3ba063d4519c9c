"""Model FLOPs of one training step, from the run config alone (the MFU numerator).

Convention (Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters", appendix; the same as Kaplan/Chinchilla's 6N plus attention):

GPT, per training step, with T = batch_size * seq_len tokens, l = n_layer, h = n_embd, s = seq_len,
V = vocab_size::

    N     = 12 * l * h**2 + V * h          (matmul weights: QKV 3h^2, proj h^2, MLP 8h^2 per layer,
                                            plus the LM head; biases, LayerNorms and the position
                                            embedding do no matmul and are left out)
    FLOPs = 6 * N * T  +  12 * l * s * h * T

both counted part by part from the model's description (``mpipar.models.counts``:
``matmul_params``, ``forward_flops_per_token``), the one the trainer builds.

i.e. forward 2 FLOPs per multiply-add, backward twice the forward (input and weight gradients),
and the attention scores QK^T and the weighted sum AV (4*s*h per token and layer, forward) times
3. This equals Megatron's ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``. It is *model* FLOPs: the
causal mask is not discounted and activation recomputation is not counted (it is hardware work,
not model work), so MFU compares runs with and without recomputation fairly.

MLP, per training step with ``batch_size`` samples: ``FLOPs = 6 * P * samples`` where P counts
weights and biases of the linear layers.

A ``n_params`` field in ``config["model"]`` (or the config) overrides the count from the shape.
Configs may be flat (``batch_size`` at the top) or in sections as ``mpipar.config`` writes them
(``train.batch_size``, ``train.seq_len``, ``parallel.schedule``, ...): ``setting`` reads both.
"""

from __future__ import annotations

from ..models.counts import forward_flops_per_token, matmul_params
from ..models.spec import GPTDims

SECTIONS = ("train", "parallel", "model", "run", "data")


def setting(config: dict, key: str, default=None):
    """``config[key]``, else the first ``config[section][key]`` (sections of mpipar.config)."""
    if key in config and not isinstance(config[key], dict):
        return config[key]
    for section in SECTIONS:
        sub = config.get(section)
        if isinstance(sub, dict) and key in sub:
            return sub[key]
    return default


def model_section(config: dict) -> dict:
    model = config.get("model", {})
    return model if isinstance(model, dict) else {}


def model_kind(config: dict) -> str:
    """``"gpt"``, ``"mlp"`` or ``"unknown"``, from ``model.kind`` (type, name) or its fields."""
    model = model_section(config)
    for key in ("kind", "type", "name", "arch"):
        v = str(model.get(key, "")).lower()
        if "gpt" in v:
            return "gpt"
        if "mlp" in v:
            return "mlp"
    if "n_layer" in model and "n_embd" in model:
        return "gpt"
    if _mlp_sizes(model):
        return "mlp"
    return "unknown"


def seq_len(config: dict) -> int | None:
    """Tokens per sequence in training: ``seq_len`` (train section), else the model's block_size."""
    s = setting(config, "seq_len") or setting(config, "block_size")
    return int(s) if s else None


def _mlp_sizes(model: dict) -> list[int] | None:
    """Layer widths [d_in, h1, ..., d_out] of an MLP config, in the spellings we accept."""
    for key in ("sizes", "layer_sizes", "dims", "widths"):
        if isinstance(model.get(key), (list, tuple)) and len(model[key]) >= 2:
            return [int(v) for v in model[key]]
    d_in = model.get("d_in", model.get("in_features", model.get("input_dim")))
    d_out = model.get("d_out", model.get("out_features", model.get("output_dim")))
    hidden = model.get("d_hidden", model.get("hidden", model.get("hidden_dim", model.get("width"))))
    depth = model.get("n_layers", model.get("depth", model.get("n_layer")))
    if d_in and d_out and hidden and depth:
        # depth linear layers: d_in -> hidden -> ... -> hidden -> d_out
        return [int(d_in)] + [int(hidden)] * (int(depth) - 1) + [int(d_out)]
    return None


def n_params(config: dict) -> int | None:
    """Parameters in the FLOP count (see module doc): matmul weights for GPT, all for an MLP."""
    model = model_section(config)
    for src in (model, config):
        if src.get("n_params"):
            return int(src["n_params"])
    kind = model_kind(config)
    if kind == "gpt":
        if not all(model.get(k) for k in ("n_layer", "n_embd", "vocab_size")):
            return None
        return matmul_params(GPTDims.of(model))
    if kind == "mlp":
        sizes = _mlp_sizes(model)
        if sizes:
            return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    return None


def tokens_per_step(config: dict) -> int | None:
    """Tokens (GPT) or samples (MLP) consumed by one step: the global batch times seq_len."""
    batch = setting(config, "batch_size")
    if not batch:
        return None
    if model_kind(config) == "mlp":
        return int(batch)
    s = seq_len(config)
    return int(batch) * s if s else None


def flops_per_step(config: dict) -> float | None:
    """Model FLOPs of one training step (module doc), or None if the config lacks a field."""
    n, t = n_params(config), tokens_per_step(config)
    if n is None or t is None:
        return None
    flops = 6.0 * n * t
    model = model_section(config)
    if model_kind(config) == "gpt" and model.get("n_layer") and model.get("n_embd"):
        # the attention's score and value products: forward FLOPs beyond the matmul weights'
        dims = GPTDims.of({"vocab_size": 1, **model})
        attention = forward_flops_per_token(dims, seq_len(config)) - 2 * matmul_params(dims)
        flops += 3.0 * attention * t
    return flops
