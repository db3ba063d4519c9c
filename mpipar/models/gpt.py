"""The GPT decoder for any tensor-parallel mode, built from its one description (``spec``).

The same builder makes the one-rank model (tp = 1: every communication operator an identity)
and each tensor-parallel rank's shard of it, for 1d, 2d, 2.5d and 3d alike: the mode's layer
factory (``parallel.tensor_nd.layer_factory``) implements the parts; every weight is a shard of
the same full-shape master (seed + name), so all grids compute the same function.
"""

from __future__ import annotations

from ..nn.layers import GELU, Layer, ParamFactory, ReLU, Residual, Sequential
from ..parallel.tensor import TPContext
from ..parallel.tensor_nd import layer_factory
from ..parallel.tp_split import TPSplit
from . import spec
from .model import Model, full_size

_ACTIVATIONS = {"gelu": GELU, "relu": ReLU}


def check_gpt_shapes(m, tp_size=1, sequence_parallel=False, seq_len=None,
                     split: TPSplit | None = None) -> None:
    """Raise ValueError naming the field and the fix when sizes do not fit together: the one
    check of every tp mode's divisibility (``TPSplit.requirements``). ``split``: the cut of a
    2d / 2.5d / 3d run (``TPSplit.of``); 1d over ``tp_size`` when not given."""
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = "
                         f"{m.n_head}: pick n_head dividing n_embd")
    split = split or TPSplit.of("1d", tp_size, sequence_parallel=sequence_parallel)
    for what, n, by, how in split.requirements(m.n_embd, m.n_head, m.vocab_size):
        if n % by:
            raise ValueError(f"{what} = {n} is not divisible by {how}: choose a "
                             f"{what.split('.')[-1].split(' ')[0]} that {by} divides, or "
                             f"another tp")
    if seq_len is not None:
        if seq_len > m.block_size:
            raise ValueError(f"train.seq_len = {seq_len} is longer than the context "
                             f"model.block_size = {m.block_size}: lower seq_len or raise "
                             f"block_size")
        if seq_len % split.seq_shards:
            raise ValueError(f"sequence parallelism splits train.seq_len = {seq_len} over tp = "
                             f"{split.size}: choose a seq_len divisible by tp")


def _parts(layers, parts) -> list[Layer]:
    out: list[Layer] = []
    for part in parts:
        if isinstance(part, spec.Norm):
            out.append(layers.norm(part))
        elif isinstance(part, spec.Linear):
            out.extend(layers.linear(part))
        elif isinstance(part, spec.Attention):
            out.append(layers.attention(part))
        elif isinstance(part, spec.Activation):
            out.append(_ACTIVATIONS[part.fn](part.name))
        else:
            raise TypeError(f"no layer for the part {part!r} inside a block")
    return out


def build_block(layers, unit: spec.Unit) -> Layer:
    """A block: each residual branch's parts, implemented by the mode's ``layers``."""
    return Sequential([Residual(Sequential(_parts(layers, b.parts), name=b.name),
                                f"{b.name}.res") for b in unit.parts], name=unit.name)


def build_gpt(mcfg, backend, seed=0, tp=None) -> Model:
    """Units: [embedding] + [block] * n_layer + [final LN and LM head] (``spec.gpt_units``)."""
    tp = tp or TPContext()
    split = tp.split
    check_gpt_shapes(mcfg, split=split)
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    layers = layer_factory(tp, pf)
    embed_spec, *block_specs, head_spec = spec.gpt_units(spec.GPTDims.of(mcfg))
    embed, table = layers.embedding(*embed_spec.parts)
    norm, logits = head_spec.parts
    head = layers.tied_head(logits, table) if logits.tied else layers.linear(logits)
    units = [embed, *(build_block(layers, u) for u in block_specs),
             Sequential([layers.norm(norm), *head], name="head")]
    d, v = mcfg.n_embd, mcfg.vocab_size
    model = Model("gpt", units, layers.loss(),
                  out_widths=[d // split.hidden("residual")] * (mcfg.n_layer + 1)
                  + [v // split.hidden("inner")],
                  seq_shards=split.seq_shards, batch_shards=split.batch_shards)
    model.n_params_full = full_size(model.params())
    return model


def gpt_block(pf: ParamFactory, tp: TPContext, i: int, d: int, n_head: int) -> Layer:
    """One block alone on this rank (tests measure what it keeps)."""
    return build_block(layer_factory(tp, pf), spec.gpt_block(i, d, n_head))

