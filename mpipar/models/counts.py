"""Parameters, FLOPs and activation values of each unit, counted from the description (``spec``).

What the builder makes from ``spec.gpt_units`` is what is counted here from it, part by part,
with the tp mode's cut (``parallel.tp_split.TPSplit``); tests/test_model_description.py holds
the counts to the arrays of built models. Activations are counted as mpipar's layers keep them
(``nn.layers``, ``parallel.tensor_nd``), per token of a micro-batch, in values of the dtype:

- stored (forward to backward): a LayerNorm keeps x-hat and one reciprocal deviation per token;
  a linear keeps its input (a column linear the gathered input under sequence parallelism); the
  attention core keeps q, k, v (its input) and the probabilities (H S per token: what selective
  recomputation drops); GELU keeps its input and its tanh; ReLU keeps its output, which is the
  next linear's input (nothing of its own).
- retained (backward-input to weight pass): each LayerNorm's and column linear's input gradient,
  the fused q/k/v output gradient, and under sequence parallelism the row linears' gathered
  output gradients; buffers the backward gives back to ``nn.cpu``'s pool are not retained.
- work: the transient buffers the pool keeps at a unit's peak (an activation's two gradients,
  ``RESIDUAL_WORK`` arrays of the residual width, selective recomputation's rebuilt
  probabilities and output, the head's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.tp_split import TPSplit
from . import spec

RESIDUAL_WORK = 7  # residual outputs and LayerNorm backward sums of a block's forward and backward
# arrays of its own an activation keeps for its backward (ReLU's output is the next linear's
# input, counted there)
ACTIVATION_KEEPS = {"gelu": 2, "relu": 0}
ID_BYTES = 8  # token ids are int64
ONE_RANK = TPSplit()  # no tensor parallelism: full shapes


@dataclass(frozen=True)
class UnitCounts:
    params_full: int  # values of the unit's own parameters, full shapes
    params: float  # ... this rank's shards of them
    flops: float  # forward FLOPs per token (2 per multiply-add), all tp ranks together
    stored: float  # values per token kept from the forward to the backward on this rank
    core: float  # of which the attention probabilities (selective recomputation drops them)
    retained: float  # values per token of gradients held from backward-input to the weight pass
    work: float  # values per token of transient buffers the pool keeps at this unit's peak
    scratch: float  # weight-gradient scratch: one per weight shape (``cpu.matmul``), values
    id_bytes: int = 0  # bytes per token of token ids kept (the embedding)


def part_params(part, split: TPSplit = ONE_RANK) -> float:
    """This rank's values of a part's parameters (full shapes with the default split)."""
    return sum(n / split.params(kind) for kind, n in part.tensors())


def part_flops(part, seq: int) -> int:
    """Forward FLOPs per token: a linear 2 d_in d_out (a tied head too), attention 4 S d (the
    scores Q K^T and the weighted sum of V, causal mask not discounted)."""
    if isinstance(part, spec.Linear):
        return 2 * part.d_in * part.d_out
    if isinstance(part, spec.Attention):
        return 4 * seq * part.n_head * part.head_dim
    return 0


def _v(split: TPSplit, region: str, width: float) -> float:
    return width / (split.tokens(region) * split.hidden(region))


def _stored(part, split: TPSplit, seq: int) -> tuple[float, float]:
    """(values per token a part keeps, of which attention probabilities)."""
    if isinstance(part, spec.Norm):
        return _v(split, "residual", part.d) + 1 / split.tokens("residual"), 0.0
    if isinstance(part, spec.Linear):
        return _v(split, "column_in" if part.cut == "column" else "inner", part.d_in), 0.0
    if isinstance(part, spec.Attention):
        d = part.n_head * part.head_dim
        probs = _v(split, "inner", part.n_head * seq)
        return _v(split, "inner", 3 * d) + probs, probs
    if isinstance(part, spec.Activation):
        return 0.0, 0.0  # counted with its neighbours: see _activation
    return 0.0, 0.0


def _retained(part, split: TPSplit) -> float:
    gathered = (split.tokens("column_in"), split.hidden("column_in")) != \
        (split.tokens("residual"), split.hidden("residual"))
    if isinstance(part, spec.Norm):
        return _v(split, "residual", part.d)
    if isinstance(part, spec.Linear) and part.cut == "column":
        fused = _v(split, "inner", part.d_out) if part.fused > 1 else 0.0
        return _v(split, "residual", part.d_in) + fused
    if isinstance(part, spec.Linear) and gathered:
        return _v(split, "column_in", part.d_out)
    return 0.0


def _activation(parts, split: TPSplit) -> tuple[float, float]:
    """(stored, work) of the activations among ``parts``: what each keeps of its own
    (``ACTIVATION_KEEPS``, in widths of the column linear's output); its backward's two
    gradients are pool work."""
    stored = work = 0.0
    for prev, part in zip(parts, parts[1:], strict=False):
        if isinstance(part, spec.Activation):
            width = _v(split, "inner", prev.d_out)
            stored += width * ACTIVATION_KEEPS[part.fn]
            work += 2 * width
    return stored, work


def _block(unit: spec.Unit, split: TPSplit, seq: int, selective: bool) -> UnitCounts:
    parts = unit.leaves()
    stored = core = retained = 0.0
    for part in parts:
        s, c = _stored(part, split, seq)
        stored, core, retained = stored + s, core + c, retained + _retained(part, split)
    act_stored, act_work = _activation(parts, split)
    d = parts[0].d
    work = act_work + RESIDUAL_WORK * _v(split, "column_in", d)
    if selective:  # the probabilities and the attention output rebuilt in the backward
        work += core + sum(_v(split, "inner", p.n_head * p.head_dim) for p in parts
                           if isinstance(p, spec.Attention))
    return UnitCounts(
        params_full=int(sum(part_params(p) for p in parts)),
        params=sum(part_params(p, split) for p in parts),
        flops=sum(part_flops(p, seq) for p in parts), stored=stored + act_stored, core=core,
        retained=retained, work=work,
        scratch=sum({(p.d_in, p.d_out): p.d_in * p.d_out / split.params(f"{p.cut}.weight")
                     for p in parts if isinstance(p, spec.Linear)}.values()))


def _embed(unit: spec.Unit, split: TPSplit) -> UnitCounts:
    tok, _ = unit.parts
    return UnitCounts(int(sum(part_params(p) for p in unit.parts)),
                      sum(part_params(p, split) for p in unit.parts), 0, 0.0, 0.0, 0.0,
                      2 * _v(split, "residual", tok.d), 0.0, id_bytes=ID_BYTES)


def _head(unit: spec.Unit, split: TPSplit, seq: int) -> UnitCounts:
    norm, logits = unit.parts
    # the loss keeps the softmax and the logits' gradient from its forward to the backward
    loss = 2 * _v(split, "inner", logits.d_out)
    return UnitCounts(
        params_full=int(sum(part_params(p) for p in unit.parts)),
        params=sum(part_params(p, split) for p in unit.parts),
        flops=part_flops(logits, seq),
        stored=_stored(norm, split, seq)[0] + _stored(logits, split, seq)[0] + loss, core=0.0,
        retained=_retained(norm, split) + _retained(logits, split),
        work=_v(split, "inner", logits.d_out),
        scratch=logits.d_in * logits.d_out / split.params("column.weight"))


def gpt_counts(dims: spec.GPTDims, split: TPSplit = ONE_RANK, seq: int | None = None,
               selective: bool = False) -> list[UnitCounts]:
    """The counts of every unit of the GPT ``dims`` on one rank of ``split``, sequences of
    ``seq`` tokens (the context ``block_size`` when not given)."""
    seq = seq or dims.block_size
    out = []
    for unit in spec.gpt_units(dims):
        if unit.kind == "embed":
            out.append(_embed(unit, split))
        elif unit.kind == "head":
            out.append(_head(unit, split, seq))
        else:
            out.append(_block(unit, split, seq, selective))
    return out


def block_counts(dims: spec.GPTDims, split: TPSplit = ONE_RANK, seq: int | None = None,
                 selective: bool = False) -> UnitCounts:
    """The counts of one block (every block of a GPT is alike)."""
    unit = spec.gpt_block(0, dims.n_embd, dims.n_head)
    return _block(unit, split, seq or dims.block_size, selective)


def boundary_values(dims: spec.GPTDims, split: TPSplit = ONE_RANK) -> float:
    """Values per token of the activation between two units on one rank (the residual)."""
    return _v(split, "residual", dims.n_embd)


def param_count(dims: spec.GPTDims) -> int:
    """Every parameter of the GPT, full shapes (a tied head adds none of its own)."""
    return sum(u.params_full for u in gpt_counts(dims))


def matmul_params(dims: spec.GPTDims) -> int:
    """Weights that multiply activations: every linear's, the LM head's even when tied (its
    GEMM is done either way). 6 N per token of training is their FLOP count."""
    return sum(p.d_in * p.d_out for u in spec.gpt_units(dims) for p in u.leaves()
               if isinstance(p, spec.Linear))


def forward_flops_per_token(dims: spec.GPTDims, seq: int) -> int:
    """Forward FLOPs per token of the whole model (2 per multiply-add, no recomputation)."""
    return sum(part_flops(p, seq) for u in spec.gpt_units(dims) for p in u.leaves())


def block_flops(dims: spec.GPTDims, seq: int) -> dict[str, int]:
    """Forward FLOPs per token of each part of one block, by the part's name in the block
    (``attn.qkv``, ``attn.core``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``)."""
    unit = spec.gpt_block(0, dims.n_embd, dims.n_head)
    return {p.name.split(".", 2)[2]: part_flops(p, seq) for p in unit.leaves()
            if part_flops(p, seq)}


def mlp_unit_params(sizes) -> list[int]:
    """Full parameters of each unit (one linear with its bias)."""
    return [a * o + o for a, o in zip(sizes[:-1], sizes[1:], strict=True)]
