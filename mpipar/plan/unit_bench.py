"""The time of mpipar's own model units on this machine, at two fixed reference shapes.

A FLOP count and a memory rate miss what NumPy costs around them: a call's dispatch (a GPT block
makes dozens), the element-wise work of the backward (LayerNorm, GELU and softmax gradients
move more bytes than the forward), the strided products of the weight pass. So ``mpipar plan
measure`` times a real GPT block, the GPT head and embedding, and an MLP unit (their
forward, backward-input and weight pass, through ``mpipar.models`` on one thread) at a tiny shape
(``FLOOR``: the per-call floor) and at a reference shape (``REF``: work well above the floor),
and writes the times to the spec's ``[units]`` section. ``mpipar.plan.here`` reads them as: a
unit's phase costs its floor, plus its GEMM time, plus ``k`` times its element-wise time, with
``k`` the one factor per (unit kind, phase) that makes the reference shape come out as measured.
The shapes are fixed here, never a validation run's.
"""

from __future__ import annotations

import time

import numpy as np

# (GPT: n_embd, n_head, seq, batch; MLP: width, batch)
FLOOR = {"gpt": (8, 2, 8, 1), "mlp": (8, 1)}
REF = {"gpt": (96, 4, 48, 4), "mlp": (192, 48)}
PHASES = ("f", "b", "w")


def _gpt_model(d: int, heads: int, seq: int):
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model

    cfg = load_config(None, {"model.kind": "gpt", "model.vocab_size": "256",
                             "model.block_size": str(seq), "model.n_layer": "1",
                             "model.n_embd": str(d), "model.n_head": str(heads),
                             "train.seq_len": str(seq)})
    return build_model(cfg.model, Backend("cpu", "float32"))


def _mlp_model(width: int):
    return _mlp_model_of([width] * 3)


def _phases(unit, x, dy, budget: float) -> tuple[float, float, float]:
    """Median forward, backward-input and weight pass of ``unit`` over repeats in ``budget``
    (the median, not the fastest: a dump's unit costs are means over a run's steps)."""
    got = []
    end, n = time.perf_counter() + budget, 0
    while n < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        unit.forward(x)
        t1 = time.perf_counter()
        unit.backward_input(dy)
        t2 = time.perf_counter()
        unit.backward_weight()
        t3 = time.perf_counter()
        got.append((t1 - t0, t2 - t1, t3 - t2))
        n += 1
    return tuple(float(x) for x in np.median(np.array(got), axis=0))


class _WithLoss:
    """The head followed by its loss, as the last stage runs them (F + LOSS, then B)."""

    def __init__(self, head, loss, targets):
        self.head, self.loss, self.targets = head, loss, targets

    def forward(self, x):
        self.loss.forward(self.head.forward(x), self.targets)

    def backward_input(self, dy):
        self.head.backward_input(self.loss.backward())

    def backward_weight(self):
        self.head.backward_weight()


def gpt_units(d: int, heads: int, seq: int, b: int, budget: float) -> dict:
    """{"embed_f": s, ..., "block_w": s, "head_w": s} of a one-block GPT at this shape (the
    head with its cross-entropy loss)."""
    model = _gpt_model(d, heads, seq)
    emb, blk, head = model.units
    tok = np.zeros((b, seq), np.int64)
    h = emb.forward(tok)
    out = {}
    for name, unit, x, dy in (("embed", emb, tok, np.ones_like(h)), ("block", blk, h, h),
                              ("head", _WithLoss(head, model.loss, tok), h, None)):
        for ph, t in zip(PHASES, _phases(unit, x, dy, budget), strict=True):
            out[f"{name}_{ph}"] = t
    return out


def mlp_units(width: int, b: int, budget: float) -> dict:
    """{"linear_f": s, "linear_b": s, "linear_w": s} of one MLP unit (linear + activation)."""
    model = _mlp_model(width)
    x = np.ones((b, width), np.float32)
    return {f"linear_{ph}": t for ph, t in zip(PHASES, _phases(model.units[0], x, x, budget),
                                               strict=True)}


def optimizer_per_tensor(budget: float, tensors: int = 32) -> float:
    """Median seconds of mpipar's AdamW step per parameter tensor, over ``tensors`` tiny ones
    (an MLP of 8-wide linears, weight and bias each): the per-tensor cost that a step pays
    whatever the sizes (its traffic is the element-wise rate's, counted apart)."""
    from mpipar.nn.optim import AdamW

    model = _mlp_model_of([8] * (tensors // 2 + 1))
    params = model.params()
    for prm in params:
        prm.grad[...] = 1e-3
    opt = AdamW(params, lr=1e-3, weight_decay=0.1)
    got = []
    end = time.perf_counter() + budget
    while len(got) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        opt.step()
        got.append(time.perf_counter() - t0)
    return float(np.median(got)) / len(params)


def _mlp_model_of(sizes):
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model

    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": "[" + ",".join(map(str, sizes))
                             + "]"})
    return build_model(cfg.model, Backend("cpu", "float32"))


def measure_units(quick: bool) -> dict:
    """{"floor_<unit>_<phase>": s, "ref_<unit>_<phase>": s, "opt_tensor": s} (seconds)."""
    budget = 0.05 if quick else 0.4
    out = {"opt_tensor": optimizer_per_tensor(budget)}
    for tag, shapes in (("floor", FLOOR), ("ref", REF)):
        got = gpt_units(*shapes["gpt"], budget) | mlp_units(*shapes["mlp"], budget)
        out.update({f"{tag}_{k}": v for k, v in got.items()})
    return out
