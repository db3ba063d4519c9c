"""The GPT of ``models.build_gpt`` on a q x q x q tensor-parallel cube (3D): the same units,
parameter names and full-shape masters as every other mode."""

from __future__ import annotations

from ...nn.layers import GELU, CausalSelfAttention, Layer, ParamFactory, Residual, Sequential
from .context3d import TP3DContext
from .layers3d import (
    CrossEntropy3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    PositionEmbedding3D,
)


def check_gpt_shapes_3d(m, q: int) -> None:
    """Raise ValueError naming the field and the fix: 3D cuts a weight's rows by q^2 (the hidden
    size and the vocabulary) and heads by q."""
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = "
                         f"{m.n_head}: pick n_head dividing n_embd")
    for what, n, by in (("model.n_embd", m.n_embd, q * q), ("model.n_head", m.n_head, q),
                        ("model.vocab_size", m.vocab_size, q * q)):
        if n % by:
            raise ValueError(f"{what} = {n} is not divisible by {by} (tp_mode 3d, q = {q}): "
                             f"choose a {what.split('.')[1]} that {by} divides, or another tp")


def gpt_block_3d(pf: ParamFactory, tp: TP3DContext, i: int, d: int, n_head: int) -> Layer:
    """Pre-LN block: parity 0 in and out; q/k/v come out in parity 1 with heads cut over j."""
    p = f"blocks.{i}"
    attn = Sequential([
        LayerNorm3D(pf, tp, f"{p}.ln1", d),
        Linear3D(pf, tp, f"{p}.attn.qkv", d, 3 * d, 0, w_shape=(d, 3, d), axes=(0, 2),
                 b_shape=(3, d), b_axis=1),
        CausalSelfAttention(tp.divide(n_head, "model.n_head"), d // n_head,
                            name=f"{p}.attn.core"),
        Linear3D(pf, tp, f"{p}.attn.proj", d, d, 1),
    ], name=f"{p}.attn")
    mlp = Sequential([
        LayerNorm3D(pf, tp, f"{p}.ln2", d),
        Linear3D(pf, tp, f"{p}.mlp.fc", d, 4 * d, 0),
        GELU(f"{p}.mlp.gelu"),
        Linear3D(pf, tp, f"{p}.mlp.proj", 4 * d, d, 1),
    ], name=f"{p}.mlp")
    return Sequential([Residual(attn, f"{p}.attn.res"), Residual(mlp, f"{p}.mlp.res")], name=p)


def build_gpt_3d(mcfg, backend, seed, tp: TP3DContext):
    from ...models import Model, _count_full

    check_gpt_shapes_3d(mcfg, tp.q)
    if mcfg.tie_embeddings:
        raise ValueError("model.tie_embeddings is for tp_mode 1d: set tie_embeddings = false")
    d = mcfg.n_embd
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    embed = Sequential([Embedding3D(pf, tp, "embed.tok", mcfg.vocab_size, d),
                        PositionEmbedding3D(pf, tp, "embed.pos", mcfg.block_size, d)],
                       name="embed")
    blocks = [gpt_block_3d(pf, tp, i, d, mcfg.n_head) for i in range(mcfg.n_layer)]
    final = Sequential([LayerNorm3D(pf, tp, "ln_f", d),
                        Linear3D(pf, tp, "head", d, mcfg.vocab_size, 0, bias=False)],
                       name="head")
    model = Model("gpt", [embed, *blocks, final], CrossEntropy3D(tp),
                  out_widths=[d // tp.q] * (mcfg.n_layer + 1) + [mcfg.vocab_size // tp.q],
                  batch_shards=tp.batch_shards)
    model.n_params_full = _count_full(model.params())
    return model
