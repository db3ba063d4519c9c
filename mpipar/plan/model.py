"""The GPT shape the planner costs, its presets, and its exact per-layer FLOP count.

FLOPs are 2 per multiply-add. One transformer layer's forward on a micro-batch of b sequences
of s tokens, hidden h (Megatron-LM's GPT; Narayanan et al. 2021, appendix)::

    QKV projection      2 * b*s * h * 3h   = 6 b s h^2
    scores Q K^T        2 * b * s * s * h  = 2 b s^2 h   (all heads together: a * s*s*(h/a))
    attention over V    2 * b * s * s * h  = 2 b s^2 h
    output projection   2 * b*s * h * h    = 2 b s h^2
    MLP h->4h->h        2 * 2 * b*s * h*4h = 16 b s h^2
    total               24 b s h^2 + 4 b s^2 h

The logits layer (last stage) is 2 b s h V; the embedding (first stage) is a gather, no GEMM, and
is costed in bytes. The backward is twice the forward (input and weight gradients). The causal
mask is not discounted (as Megatron counts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import tomllib

from ..models.counts import block_flops, param_count, part_flops
from ..models.spec import GPTDims, gpt_head
from .errors import PlanError


@dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 51200
    name: str = "custom"

    def check(self) -> None:
        for key in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"model {key} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise PlanError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                "choose heads dividing the hidden size"
            )

    def as_dict(self) -> dict:
        return asdict(self)

    def dims(self) -> GPTDims:
        """The model description's sizes: Megatron's GPT, the LM head tied to the embedding,
        positions learned up to ``seq``."""
        return GPTDims(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                       vocab_size=self.vocab, block_size=self.seq, tie_embeddings=True)


def layer_gemm_flops(m: GPTShape, b: int) -> dict[str, float]:
    """Forward FLOPs of one layer's GEMMs for a micro-batch of b sequences, by GEMM (the
    block's parts in ``mpipar.models.spec``; the attention core is the scores and the values)."""
    f, tokens = block_flops(m.dims(), m.seq), b * m.seq
    return {
        "qkv": float(tokens * f["attn.qkv"]),
        "scores": float(tokens * f["attn.core"] // 2),
        "values": float(tokens * f["attn.core"] // 2),
        "proj": float(tokens * f["attn.proj"]),
        "mlp": float(tokens * (f["mlp.fc"] + f["mlp.proj"])),
    }


def logits_flops(m: GPTShape, b: int) -> float:
    """Forward FLOPs of the logits GEMM (last stage) for b sequences."""
    head = gpt_head(m.dims()).parts[-1]
    return float(b * m.seq * part_flops(head, m.seq))


def model_flops_per_step(m: GPTShape, batch: int) -> float:
    """Model FLOPs of one step (no recomputation): 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    layer = sum(layer_gemm_flops(m, batch).values())
    return 3.0 * (m.layers * layer + logits_flops(m, batch))


def megatron_sc21_flops(m: GPTShape, batch: int) -> float:
    """Narayanan et al. 2021's count, with full recomputation's extra forward of the layers:
    96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    s, h, l, V = m.seq, m.hidden, m.layers, m.vocab
    return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def n_params(m: GPTShape) -> float:
    """Weights of the whole model (``models.counts``): 12 l h^2 + 13 l h (biases, LayerNorms),
    embeddings V h + s h, the final LayerNorm 2 h."""
    return float(param_count(m.dims()))


# Megatron-LM SC'21 (Narayanan et al. 2021, Table 1), seq 2048, vocab 51,200; plus GPT-3 175B.
PRESETS: dict[str, GPTShape] = {
    name: GPTShape(layers=l, hidden=h, heads=a, seq=2048, vocab=51200, name=name)
    for name, l, h, a in (
        ("gpt-1.7b", 24, 2304, 24),
        ("gpt-3.6b", 30, 3072, 32),
        ("gpt-7.5b", 36, 4096, 32),
        ("gpt-18b", 40, 6144, 48),
        ("gpt-39b", 48, 8192, 64),
        ("gpt-76b", 60, 10240, 80),
        ("gpt-145b", 80, 12288, 96),
        ("gpt-310b", 96, 16384, 128),
        ("gpt-530b", 105, 20480, 128),
        ("gpt-1t", 128, 25600, 160),
        ("gpt3-175b", 96, 12288, 96),
    )
}


def load_model(spec: str) -> GPTShape:
    """A preset name, or a TOML file with layers/hidden/heads/seq/vocab (top level or [model];
    mpipar's config names n_layer/n_embd/n_head/block_size/vocab_size are accepted too)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise PlanError(
            f"--model {spec!r} is neither a preset nor a file; presets: {', '.join(PRESETS)}"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{path}: not valid TOML: {exc}") from exc
    data = data.get("model", data)
    aliases = {
        "layers": ("layers", "n_layer"),
        "hidden": ("hidden", "n_embd"),
        "heads": ("heads", "n_head"),
        "seq": ("seq", "seq_len", "block_size"),
        "vocab": ("vocab", "vocab_size"),
    }
    fields = {}
    for key, names in aliases.items():
        found = [data[n] for n in names if n in data]
        if not found:
            raise PlanError(f"{path}: the model needs {key!r} (or {' / '.join(names[1:])})")
        fields[key] = found[0]
    shape = GPTShape(**fields, name=path.stem)
    shape.check()
    return shape
