"""The GPT described once, as data: its units, the parts of each, their names and full shapes.

Megatron's layer-spec idea: the block lists its parts (LayerNorm, linears with the side of the
tensor-parallel pair they take, the attention core, the activation); a tp mode supplies the
layers that implement them (``parallel.tensor.Megatron1DLayers``, ``parallel.tensor_nd``'s
2D / 2.5D / 3D factories). ``models.gpt`` builds a model from this description, and
``models.counts`` counts parameters, FLOPs and stored activations from the same description,
so the builder, the planner and the memory model cannot disagree on what a block is.
Every parameter name (``blocks.3.attn.qkv.weight``: the part's name here plus the layer's
``weight`` / ``bias``) comes from this module; checkpoints depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTDims:
    """The sizes a GPT is made of (``config.ModelConfig``'s GPT fields)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    tie_embeddings: bool = False

    @classmethod
    def of(cls, m) -> GPTDims:
        """From a ``ModelConfig`` (or anything with its attributes) or a dict of its fields."""
        get = m.get if isinstance(m, dict) else (lambda k, d=None: getattr(m, k, d))
        return cls(int(get("n_layer")), int(get("n_embd")), int(get("n_head", 1)),
                   int(get("vocab_size")), int(get("block_size", 0) or 0),
                   bool(get("tie_embeddings", False)))


@dataclass(frozen=True)
class Norm:
    name: str
    d: int

    def tensors(self):
        return [("norm", self.d), ("norm", self.d)]  # gain and bias


@dataclass(frozen=True)
class Linear:
    """y = x W + b. ``cut``: "column" (the first linear of a tp pair: output split) or "row"
    (the second: input split). ``fused``: q, k and v in one weight of full shape
    (d_in, fused, d_out / fused), so that a column shard holds whole heads of each.
    ``tied``: the weight is the token table (a head tied to the embedding), not its own."""

    name: str
    d_in: int
    d_out: int
    cut: str
    bias: bool = True
    fused: int = 1
    tied: bool = False

    @property
    def w_shape(self) -> tuple:
        if self.fused == 1:
            return (self.d_in, self.d_out)
        return (self.d_in, self.fused, self.d_out // self.fused)

    @property
    def b_shape(self) -> tuple:
        return (self.d_out,) if self.fused == 1 else (self.fused, self.d_out // self.fused)

    def tensors(self):
        own = [] if self.tied else [(f"{self.cut}.weight", self.d_in * self.d_out)]
        return own + ([(f"{self.cut}.bias", self.d_out)] if self.bias else [])


@dataclass(frozen=True)
class Attention:
    """Causal self-attention on q, k, v (its input): weightless."""

    name: str
    n_head: int
    head_dim: int

    def tensors(self):
        return []


@dataclass(frozen=True)
class Activation:
    name: str
    fn: str = "gelu"

    def tensors(self):
        return []


@dataclass(frozen=True)
class TokenEmbedding:
    name: str
    vocab: int
    d: int

    def tensors(self):
        return [("token", self.vocab * self.d)]


@dataclass(frozen=True)
class PositionEmbedding:
    name: str
    max_len: int
    d: int

    def tensors(self):
        return [("position", self.max_len * self.d)]


@dataclass(frozen=True)
class Branch:
    """x + parts(x): a residual branch of a block."""

    name: str
    parts: tuple


@dataclass(frozen=True)
class Unit:
    """What a pipeline may cut between. ``kind``: "embed" (parts: token, position), "block"
    (parts: residual branches), "head" (parts: the final LayerNorm and the logits linear)."""

    name: str
    kind: str
    parts: tuple

    def leaves(self) -> list:
        """The parts in order, branches opened."""
        out = []
        for p in self.parts:
            out.extend(p.parts if isinstance(p, Branch) else [p])
        return out


def gpt_block(i: int, d: int, n_head: int) -> Unit:
    """Pre-LN block: x + Attn(LN(x)); x + MLP(LN(x))."""
    p = f"blocks.{i}"
    attn = Branch(f"{p}.attn", (
        Norm(f"{p}.ln1", d),
        Linear(f"{p}.attn.qkv", d, 3 * d, "column", fused=3),
        Attention(f"{p}.attn.core", n_head, d // n_head),
        Linear(f"{p}.attn.proj", d, d, "row"),
    ))
    mlp = Branch(f"{p}.mlp", (
        Norm(f"{p}.ln2", d),
        Linear(f"{p}.mlp.fc", d, 4 * d, "column"),
        Activation(f"{p}.mlp.gelu", "gelu"),
        Linear(f"{p}.mlp.proj", 4 * d, d, "row"),
    ))
    return Unit(p, "block", (attn, mlp))


def gpt_embed(dims: GPTDims) -> Unit:
    """The token table (vocabulary rows) and the learned positions."""
    return Unit("embed", "embed", (TokenEmbedding("embed.tok", dims.vocab_size, dims.n_embd),
                                   PositionEmbedding("embed.pos", dims.block_size, dims.n_embd)))


def gpt_head(dims: GPTDims) -> Unit:
    """The final LayerNorm and the logits (the token table itself when tied)."""
    return Unit("head", "head", (Norm("ln_f", dims.n_embd),
                                 Linear("head", dims.n_embd, dims.vocab_size, "column",
                                        bias=False, tied=dims.tie_embeddings)))


def gpt_units(dims: GPTDims) -> list[Unit]:
    """[embedding] + [block] * n_layer + [final LayerNorm and LM head]."""
    blocks = (gpt_block(i, dims.n_embd, dims.n_head) for i in range(dims.n_layer))
    return [gpt_embed(dims), *blocks, gpt_head(dims)]
