"""The GPT of ``models.build_gpt`` on a q x q tensor-parallel grid (Optimus): the same units,
parameter names and full-shape masters, so every grid and mode computes the one-rank function
and checkpoints move between modes."""

from __future__ import annotations

from ...nn.layers import GELU, CausalSelfAttention, Layer, ParamFactory, Residual, Sequential
from .context import COL, ROW, TP2DContext
from .layers2d import (
    CrossEntropy2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PositionEmbedding2D,
)


def check_gpt_shapes_2d(m, q: int, mode: str = "2d") -> None:
    """Raise ValueError naming the field and the fix: 2D and 2.5D cut hidden, heads, MLP width
    and vocabulary by q."""
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = "
                         f"{m.n_head}: pick n_head dividing n_embd")
    for what, n in (("model.n_embd", m.n_embd), ("model.n_head", m.n_head),
                    ("model.vocab_size", m.vocab_size)):
        if n % q:
            raise ValueError(f"{what} = {n} is not divisible by q = {q} (tp_mode {mode}): "
                             f"choose a {what.split('.')[1]} that q divides, or another tp")


def gpt_block_2d(pf: ParamFactory, tp: TP2DContext, i: int, d: int, n_head: int) -> Layer:
    """Pre-LN block on 2D blocks: heads split over the grid's columns (the q/k/v weight's
    output blocks), every linear a SUMMA product."""
    p = f"blocks.{i}"
    attn = Sequential([
        LayerNorm2D(pf, tp, f"{p}.ln1", d),
        Linear2D(pf, tp, f"{p}.attn.qkv", d, 3 * d, w_shape=(d, 3, d),
                 w_split=((0, ROW), (2, COL)), b_shape=(3, d), b_split=((1, COL),)),
        CausalSelfAttention(tp.divide(n_head, "model.n_head"), d // n_head,
                            name=f"{p}.attn.core"),
        Linear2D(pf, tp, f"{p}.attn.proj", d, d),
    ], name=f"{p}.attn")
    mlp = Sequential([
        LayerNorm2D(pf, tp, f"{p}.ln2", d),
        Linear2D(pf, tp, f"{p}.mlp.fc", d, 4 * d),
        GELU(f"{p}.mlp.gelu"),
        Linear2D(pf, tp, f"{p}.mlp.proj", 4 * d, d),
    ], name=f"{p}.mlp")
    return Sequential([Residual(attn, f"{p}.attn.res"), Residual(mlp, f"{p}.mlp.res")], name=p)


def build_gpt_2d(mcfg, backend, seed, tp: TP2DContext):
    """Units: [embedding] + [block] * n_layer + [final LN and LM head], as ``build_gpt``."""
    from ...models import Model, _count_full

    check_gpt_shapes_2d(mcfg, tp.q, tp.mode)
    if mcfg.tie_embeddings:
        raise ValueError("model.tie_embeddings is for tp_mode 1d: set tie_embeddings = false")
    d = mcfg.n_embd
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    embed = Sequential([
        Embedding2D(pf, tp, "embed.tok", mcfg.vocab_size, d),
        PositionEmbedding2D(pf, tp, "embed.pos", mcfg.block_size, d),
    ], name="embed")
    blocks = [gpt_block_2d(pf, tp, i, d, mcfg.n_head) for i in range(mcfg.n_layer)]
    final = Sequential([LayerNorm2D(pf, tp, "ln_f", d),
                        Linear2D(pf, tp, "head", d, mcfg.vocab_size, bias=False)], name="head")
    model = Model("gpt", [embed, *blocks, final], CrossEntropy2D(tp),
                  out_widths=[d // tp.q] * (mcfg.n_layer + 1) + [mcfg.vocab_size // tp.q],
                  batch_shards=tp.batch_shards)
    model.n_params_full = _count_full(model.params())
    return model
