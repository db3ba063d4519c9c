"""The GPT decoder and the MLP, built as flat lists of pipeline units for any tensor-parallel size.

A model is ``units`` (layers a pipeline may cut between) plus a ``loss`` applied after the last
unit. The same builder makes the one-rank model (tp = 1: every communication operator is an
identity) and each tensor-parallel rank's shard of it: every weight is a shard of the same
full-shape master (seed + name), so all grids compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import MODEL_KINDS
from .nn.layers import (
    GELU,
    Bias,
    CausalSelfAttention,
    Embedding,
    Layer,
    LayerNorm,
    Linear,
    ParamFactory,
    PositionEmbedding,
    ReLU,
    Residual,
    Sequential,
    TiedHead,
)
from .nn.losses import CrossEntropyLoss, MSELoss
from .nn.params import ShardSpec
from .parallel.tensor import TPContext, VocabParallelCrossEntropy


@dataclass
class Model:
    kind: str
    units: list[Layer]
    loss: object
    n_params_full: int = 0
    # last-axis width of each unit's output on this rank (what a pipeline sends after that unit)
    out_widths: list = field(default_factory=list)
    seq_shards: int = 1  # >1: activations between units hold 1/seq_shards of the sequence (SP)
    batch_shards: int = 1  # >1: ... hold 1/batch_shards of the sequences (2D tp: batch block)

    def boundary_shape(self, unit: int, batch: int, seq_len: int | None = None) -> tuple:
        """Shape of the activation leaving ``unit`` (and of its gradient) for a micro-batch."""
        if self.kind == "gpt":
            return (batch // self.batch_shards, seq_len // self.seq_shards,
                    self.out_widths[unit])
        return (batch, self.out_widths[unit])

    def params(self, units=None):
        seen, out = set(), []
        for u in self.units if units is None else units:
            for p in u.params():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def _count_full(params) -> int:
    n = 0
    for p in params:
        k = 1
        for s in p.full_shape:
            k *= s
        n += k
    return n


# ----- GPT ------------------------------------------------------------------------------------

def check_gpt_shapes(m, tp_size=1, sequence_parallel=False, seq_len=None):
    """Raise ValueError naming the field and the fix when sizes do not fit together."""
    if m.n_embd % m.n_head:
        raise ValueError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = "
                         f"{m.n_head}: pick n_head dividing n_embd")
    for what, n in (("model.n_head", m.n_head), ("4 * model.n_embd (MLP width)", 4 * m.n_embd),
                    ("model.vocab_size", m.vocab_size)):
        if n % tp_size:
            raise ValueError(f"{what} = {n} is not divisible by tp = {tp_size}: choose a tp "
                             f"that divides it")
    if seq_len is not None:
        if seq_len > m.block_size:
            raise ValueError(f"train.seq_len = {seq_len} is longer than the context "
                             f"model.block_size = {m.block_size}: lower seq_len or raise "
                             f"block_size")
        if sequence_parallel and seq_len % tp_size:
            raise ValueError(f"sequence parallelism splits train.seq_len = {seq_len} over tp = "
                             f"{tp_size}: choose a seq_len divisible by tp")


def gpt_block(pf: ParamFactory, tp: TPContext, i: int, d: int, n_head: int) -> Layer:
    """Pre-LN block: x + Attn(LN(x)); x + MLP(LN(x)), attention heads and MLP split over tp."""
    p = f"blocks.{i}"
    sp = tp.sequence_parallel
    nh_local = tp.divide(n_head, "model.n_head")
    hd = d // n_head
    attn = Sequential([
        LayerNorm(pf, f"{p}.ln1", d, partial_grad=sp),
        tp.enter(f"{p}.attn.f"),
        Linear(pf, f"{p}.attn.qkv", d, 3 * d // tp.size, w_shape=(d, 3, d), b_shape=(3, d),
               w_spec=ShardSpec(axis=2), b_spec=ShardSpec(axis=1)),
        CausalSelfAttention(nh_local, hd, name=f"{p}.attn.core"),
        Linear(pf, f"{p}.attn.proj", d, d, bias=False, w_spec=tp.row),
        tp.leave(f"{p}.attn.g"),
        Bias(pf, f"{p}.attn.proj", d, spec=ShardSpec(None, partial_grad=sp)),
    ], name=f"{p}.attn")
    mlp = Sequential([
        LayerNorm(pf, f"{p}.ln2", d, partial_grad=sp),
        tp.enter(f"{p}.mlp.f"),
        Linear(pf, f"{p}.mlp.fc", d, 4 * d, w_spec=tp.col, b_spec=ShardSpec(axis=0)),
        GELU(f"{p}.mlp.gelu"),
        Linear(pf, f"{p}.mlp.proj", 4 * d, d, bias=False, w_spec=tp.row),
        tp.leave(f"{p}.mlp.g"),
        Bias(pf, f"{p}.mlp.proj", d, spec=ShardSpec(None, partial_grad=sp)),
    ], name=f"{p}.mlp")
    return Sequential([Residual(attn, f"{p}.attn.res"), Residual(mlp, f"{p}.mlp.res")], name=p)


def build_gpt(mcfg, backend, seed=0, tp: TPContext | None = None) -> Model:
    """Units: [embedding] + [block] * n_layer + [final LN and LM head]."""
    tp = tp or TPContext()
    check_gpt_shapes(mcfg, tp.size, tp.sequence_parallel)
    d, sp = mcfg.n_embd, tp.sequence_parallel
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    tok = Embedding(pf, "embed.tok", mcfg.vocab_size, d, spec=ShardSpec(axis=0))
    embed = Sequential([
        tok,
        tp.leave("embed.g"),  # the masked lookups are partial sums over the vocabulary shards
        PositionEmbedding(pf, "embed.pos", mcfg.block_size, d,
                          shard_index=tp.rank if sp else 0, partial_grad=sp),
    ], name="embed")
    blocks = [gpt_block(pf, tp, i, d, mcfg.n_head) for i in range(mcfg.n_layer)]
    if mcfg.tie_embeddings:
        head = TiedHead(tok.table, name="head")
    else:
        head = Linear(pf, "head", d, mcfg.vocab_size, bias=False, w_spec=tp.col)
    final = Sequential([LayerNorm(pf, "ln_f", d, partial_grad=sp), tp.enter("head.f"), head],
                       name="head")
    model = Model("gpt", [embed, *blocks, final], VocabParallelCrossEntropy(tp),
                  out_widths=[d] * (mcfg.n_layer + 1) + [mcfg.vocab_size // tp.size],
                  seq_shards=tp.size if sp else 1)
    model.n_params_full = _count_full(model.params())
    return model


def unit_count(mcfg) -> int:
    """How many pipeline units ``build_model`` makes for this config, without building it: GPT:
    the embedding, ``n_layer`` blocks, the head (``build_gpt``); MLP: one per linear."""
    if mcfg.kind == "gpt":
        return mcfg.n_layer + 2
    return len(mcfg.sizes) - 1


# ----- MLP ------------------------------------------------------------------------------------

def check_mlp_shapes(mcfg, tp_size=1):
    """With tp > 1 every column-parallel width (sizes[1], sizes[3], ...) must divide by tp."""
    n = len(mcfg.sizes) - 1
    if tp_size == 1:
        return
    for i in range(0, n - 1, 2):
        if mcfg.sizes[i + 1] % tp_size:
            raise ValueError(f"model.sizes[{i + 1}] = {mcfg.sizes[i + 1]} is split over tp = "
                             f"{tp_size} (column-parallel) and must divide by it")


def build_mlp(mcfg, backend, seed=0, tp: TPContext | None = None) -> Model:
    """Linears ``sizes[0] -> sizes[1] -> ... -> sizes[-1]`` with an activation between them.

    With tp > 1 consecutive linears pair up as Megatron's MLP (column-parallel then row-parallel,
    the activation between them local to each rank); an odd last linear is replicated.
    Each linear (with what follows it) is one pipeline unit.
    """
    tp = tp or TPContext()
    check_mlp_shapes(mcfg, tp.size)
    sizes = list(mcfg.sizes)
    n = len(sizes) - 1
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    act_cls = {"relu": ReLU, "gelu": GELU}[mcfg.activation]
    units, widths = [], []
    for i in range(n):
        name = f"layers.{i}"
        paired = tp.size > 1 and (i % 2 == 0 and i + 1 < n or i % 2 == 1)
        parts: list[Layer] = []
        widths.append(sizes[i + 1] // (tp.size if paired and i % 2 == 0 else 1))
        if paired and i % 2 == 0:
            tp.divide(sizes[i + 1], f"model.sizes[{i + 1}]")
            parts += [tp.enter(f"{name}.f"),
                      Linear(pf, name, sizes[i], sizes[i + 1], w_spec=tp.col,
                             b_spec=ShardSpec(axis=0))]
        elif paired:
            parts += [Linear(pf, name, sizes[i], sizes[i + 1], bias=False, w_spec=tp.row),
                      tp.leave(f"{name}.g"), Bias(pf, name, sizes[i + 1])]
        else:
            parts.append(Linear(pf, name, sizes[i], sizes[i + 1]))
        if i < n - 1:
            parts.append(act_cls(f"{name}.act"))
        units.append(Sequential(parts, name=name))
    if mcfg.task == "classification":
        loss = CrossEntropyLoss()  # logits are replicated over tp: each rank has them all
    else:
        loss = MSELoss()
    model = Model("mlp", units, loss, out_widths=widths)
    model.n_params_full = _count_full(model.params())
    return model


_BUILDERS = {"gpt": build_gpt, "mlp": build_mlp}
assert set(_BUILDERS) == set(MODEL_KINDS), "config.MODEL_KINDS and the builders here must agree"


def build_model(mcfg, backend, seed=0, tp: TPContext | None = None) -> Model:
    if mcfg.kind not in _BUILDERS:
        raise ValueError(f"model.kind = {mcfg.kind!r}: use one of {', '.join(MODEL_KINDS)}")
    if getattr(tp, "mode", "1d") != "1d":  # 2D / 2.5D / 3D tensor parallelism: own layers
        from .parallel.tensor_nd import build_gpt_nd

        if mcfg.kind != "gpt":
            raise ValueError(f"tp_mode {tp.mode} builds the GPT only (model.kind = "
                             f"{mcfg.kind!r}): use tp_mode 1d")
        return build_gpt_nd(mcfg, backend, seed, tp)
    return _BUILDERS[mcfg.kind](mcfg, backend, seed, tp)
