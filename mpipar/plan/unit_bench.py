"""The time of mpipar's own model units on this machine, at a few fixed shapes.

A FLOP count and a memory rate miss what NumPy costs around them: a call's dispatch (a GPT block
makes dozens), the element-wise work of the backward (LayerNorm, GELU and softmax gradients
move more bytes than the forward), the strided products of the weight pass. So ``mpipar plan
measure`` times a real GPT block, the GPT head and embedding, and an MLP unit (their
forward, backward-input and weight pass, through ``mpipar.models`` on one thread) at a tiny shape
(``FLOOR``: the per-call floor), at a reference shape (``REF``: work well above the floor) and,
for the GPT units, at the other shapes of ``SHAPES`` (widths, head sizes and sequence lengths
around the reference), and writes the times to the spec's ``[units]`` section. The units run
as a step runs them (``_chain``: ``CHAIN`` distinct blocks, ``CHAIN`` micro-batches forward,
then backward), not one unit over and over with its data in cache. ``mpipar.plan.unit_fit``
reads them as: a unit's phase costs its floor, plus weighted GEMM, attention-core GEMM and
element-wise times, the weights per (unit kind, phase) fitted over the shapes and set to the
reference shape's level.
Also measured: the MLP's loss (a per-call cost) and the OPT region (gradient norm, clipping,
AdamW) per parameter tensor and per value twice: with cold caches (``_evict``), as in a step
whose parameters, gradients and moments do not fit the core's cache, and warm, on models whose
whole state fits half of it (``warm_bytes``, the cache size ``mpipar plan measure`` reads), as
in a step whose state stays there between one optimizer step and the next (the MLP's 0.6 MB).
The shapes are fixed here, never a validation run's.
"""

from __future__ import annotations

import time

import numpy as np

# (GPT: n_embd, n_head, seq, batch; MLP: width, batch)
FLOOR = {"gpt": (8, 2, 8, 1), "mlp": (8, 1)}
REF = {"gpt": (96, 4, 48, 4), "mlp": (192, 48)}
# more GPT shapes around the reference (n_embd, n_head, seq, batch): half and twice the width,
# head sizes 12 and 48, sequences 96 and 24 (192 tokens each), then 384 and 512 tokens a
# micro-batch, so that a unit's GEMM, attention core and element-wise weights are each pinned
# (``plan.unit_fit``); fixed here, never a validation run's
SHAPES = ((48, 4, 48, 4), (192, 4, 48, 4), (96, 8, 96, 2), (96, 2, 24, 8), (96, 4, 96, 4),
          (48, 2, 64, 8))
PHASES = ("f", "b", "w")


def _gpt_model(d: int, heads: int, seq: int, layers: int = 1):
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model

    cfg = load_config(None, {"model.kind": "gpt", "model.vocab_size": "256",
                             "model.block_size": str(seq), "model.n_layer": str(layers),
                             "model.n_embd": str(d), "model.n_head": str(heads),
                             "train.seq_len": str(seq)})
    return build_model(cfg.model, Backend("cpu", "float32"))


CHAIN = 4  # distinct units of a kind in a row, each run for CHAIN micro-batches
EVICT_BYTES = 64 << 20  # beyond a CPU's last-level cache (32 MiB here)
_junk: list = []


def _evict() -> None:
    """Push the caches' contents out, as a step's forward and backward do between one
    optimizer step and the next: timed over and over with nothing in between, AdamW finds
    its parameters, gradients and moments in cache (tiny GPT: 1.0 ms hot against 1.5-2.1 ms
    cold; a step's OPT region measured 2.0 ms). The unit chain needs none (no change)."""
    if not _junk:
        _junk.append(np.ones(EVICT_BYTES // 4, np.float32))
    _junk[0] += 1.0


def _chain(units, feed, budget: float, totals: list | None = None,
           least: int = 4, raw: list | None = None) -> list[tuple[float, float, float]]:
    """Per unit of ``units`` (a model's, in order), the median over repeats of its mean
    forward, backward-input and weight-pass time per micro-batch, run as a step runs them:
    ``CHAIN`` micro-batches forward through every unit (each keeping its stash), then each
    backward through every unit in reverse. A unit timed alone over and over keeps its weights
    and stash in cache; a run's units evict each other's, which costs ~25 % on this path.
    ``feed``: (micro-batch input, unit -> (output, seconds) for the last unit's forward,
    last unit's (gradient, seconds)). ``totals``: gets each repeat's whole time (all units,
    phases and micro-batches; the first, which allocates, left out); ``least``: repeats at
    least; ``raw``: gets every repeat's (units x phases) array, the first included."""
    x0, last_f, last_b = feed
    n = len(units)
    reps, end = [], time.perf_counter() + budget
    while len(reps) < least or time.perf_counter() < end:
        t = np.zeros((n, 3))
        for mb in range(CHAIN):
            x = x0
            for i, u in enumerate(units[:-1]):
                t0 = time.perf_counter()
                x = u.forward(x, mb=mb)
                t[i, 0] += time.perf_counter() - t0
            t[-1, 0] += last_f(x, mb)
        for mb in range(CHAIN):
            dy = None
            for i in range(n - 1, -1, -1):
                t0 = time.perf_counter()
                if i == n - 1:
                    dy, extra = last_b(mb)
                    t[i, 1] += extra
                    t0 = time.perf_counter()
                dy = units[i].backward_input(dy, mb=mb)
                t1 = time.perf_counter()
                units[i].backward_weight(mb=mb)
                t[i, 1] += t1 - t0
                t[i, 2] += time.perf_counter() - t1
        reps.append(t / CHAIN)
    # the first repeat allocates the stashes and the gradients: not a step's cost
    if totals is not None:
        totals.extend(float(t.sum()) * CHAIN for t in reps[1:])
    if raw is not None:
        raw.extend(reps)
    med = np.median(np.array(reps[1:]), axis=0)
    return [tuple(float(v) for v in row) for row in med]


def gpt_units(d: int, heads: int, seq: int, b: int, budget: float,
              totals: list | None = None, least: int = 4, raw: list | None = None) -> dict:
    """{"embed_f": s, ..., "block_w": s, "head_w": s} of a ``CHAIN``-block GPT at this shape
    run as a chain (``_chain``; a block's time the mean over its blocks; the head with its
    cross-entropy loss: F + LOSS, then the loss's gradient and B)."""
    model = _gpt_model(d, heads, seq, CHAIN)
    units = model.units
    tok = np.zeros((b, seq), np.int64)
    grads = {}

    def last_f(x, mb):
        t0 = time.perf_counter()
        model.loss.forward(units[-1].forward(x, mb=mb), tok)
        t1 = time.perf_counter()
        grads[mb] = model.loss.backward()  # the loss keeps one micro-batch: take it now
        grads[(mb, "t")] = time.perf_counter() - t1
        return t1 - t0

    def last_b(mb):
        return grads[mb], grads[(mb, "t")]

    got = _chain(units, (tok, last_f, last_b), budget, totals, least, raw)
    out = {}
    for name, rows in (("embed", got[:1]), ("block", got[1:-1]), ("head", got[-1:])):
        mean = np.mean(np.array(rows), axis=0)
        out.update({f"{name}_{ph}": float(t) for ph, t in zip(PHASES, mean, strict=True)})
    return out


def mlp_units(width: int, b: int, budget: float) -> dict:
    """{"linear_f": s, "linear_b": s, "linear_w": s} of an MLP unit (linear + activation),
    the mean over ``CHAIN`` distinct units run as a chain (``_chain``)."""
    model = _mlp_model_of([width] * (CHAIN + 2))
    units = model.units
    x0 = np.ones((b, width), np.float32)

    def last_f(x, mb):
        t0 = time.perf_counter()
        units[-1].forward(x, mb=mb)
        return time.perf_counter() - t0

    got = _chain(units, (x0, last_f, lambda mb: (np.ones_like(x0), 0.0)), budget)
    mean = np.mean(np.array(got[:CHAIN]), axis=0)
    out = {f"linear_{ph}": float(t) for ph, t in zip(PHASES, mean, strict=True)}
    return out | _loss_times(model.loss, x0, budget)


def _loss_times(loss, logits, budget: float) -> dict:
    """{"loss_f": s, "loss_b": s}: the MLP's loss (its own LOSS region in a run, which no
    unit above holds), median over repeats."""
    targets = np.zeros(logits.shape[0], np.int64)
    got, end = [], time.perf_counter() + budget / 4
    while len(got) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        loss.forward(logits, targets)
        t1 = time.perf_counter()
        loss.backward()
        got.append((t1 - t0, time.perf_counter() - t1))
    f, b = np.median(np.array(got), axis=0)
    return {"loss_f": float(f), "loss_b": float(b)}


def _opt_step_time(model, budget: float, cold: bool = True) -> tuple[float, int, int]:
    """(median seconds, parameter tensors, values) of what a step's OPT region does on the
    parameters of ``model``: the local gradient norm, clipping, mpipar's AdamW with the
    gradients zeroed inside the update (as a flushing step's update does, ``Step._zeroing``);
    ``cold``: the caches emptied before each call (``_evict``), else warm from the call
    before."""
    from mpipar.nn.optim import AdamW, clip_grads_, grad_norm_sq_local

    params = model.params()
    for prm in params:
        prm.grad[...] = 1e-3
    opt = AdamW(params, lr=1e-3, weight_decay=0.1)
    got = []
    end = time.perf_counter() + budget
    while len(got) < 5 or time.perf_counter() < end:
        if cold:
            _evict()
        t0 = time.perf_counter()
        clip_grads_(params, 1.0, float(np.sqrt(grad_norm_sq_local(params))))
        opt.step(zero_grad=True)
        got.append(time.perf_counter() - t0)
    return float(np.median(got)), len(params), sum(int(p.data.size) for p in params)


def _solve(big: tuple, many: tuple) -> tuple[float, float]:
    """(per tensor, per value) from two (seconds, tensors, values) timings: one of few large
    tensors (``big``: sets the per-value cost), one of many small ones (``many``: the per-tensor
    cost). Two equations, solved by a few substitutions (they converge at once: the large
    model's two tensors weigh little). Each cost is clamped at 0: where the large model's time
    is within the noise of its tensors' cost (a loaded machine), its per-value cost is 0."""
    (t_big, n_big, v_big), (t_many, n_many, v_many) = big, many
    per_tensor = 0.0
    for _ in range(4):
        per_value = max(t_big - per_tensor * n_big, 0.0) / v_big
        per_tensor = max(t_many - per_value * v_many, 0.0) / n_many
    return per_tensor, per_value


def optimizer_costs(budget: float, warm_bytes: float = 0.0) -> dict:
    """{"opt_tensor", "opt_value"}: seconds per parameter tensor and per value of the OPT
    region with cold caches; per value: ~0.5 M values in two tensors (NumPy's passes over the
    weights, gradient, moments and scratch, measured rather than counted); per tensor: the
    ``CHAIN``-block GPT at the reference shape (a real model's mix of norms, biases and
    matrices: each tensor's own norm, clipping and update calls, ~2-3x what 8-wide tensors
    alone cost). With ``warm_bytes`` (the core's cache, bytes) also {"opt_tensor_warm",
    "opt_value_warm"}: the same, warm, on a linear whose state (``STATE_VALUES`` per
    parameter) fills half of it and the ``CHAIN``-block GPT at the tiny shape."""
    d, heads, seq, _ = REF["gpt"]
    cold = _solve(_opt_step_time(_mlp_model_of(OPT_VALUES), budget),
                  _opt_step_time(_gpt_model(d, heads, seq, CHAIN), budget))
    out = {"opt_tensor": cold[0], "opt_value": cold[1]}
    if warm_bytes > 0:
        width = max(int((warm_bytes / 2 / (4 * STATE_VALUES)) ** 0.5), 8)
        d, heads, seq, _ = FLOOR["gpt"]
        warm = _solve(_opt_step_time(_mlp_model_of([width, width]), budget, cold=False),
                      _opt_step_time(_gpt_model(d, heads, seq, CHAIN), budget, cold=False))
        out |= {"opt_tensor_warm": warm[0], "opt_value_warm": warm[1]}
    return out


STATE_VALUES = 4  # values the OPT region keeps per parameter: weight, gradient, two moments
OPT_VALUES = [1024, 512]  # one linear: 0.5 M weights, the order of the runs' parameter counts


def _mlp_model_of(sizes):
    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.models import build_model

    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": "[" + ",".join(map(str, sizes))
                             + "]"})
    return build_model(cfg.model, Backend("cpu", "float32"))


STEP_REPEATS = 12  # repeats of the reference chain ``step_cv`` takes at least


def step_cv(budget: float, least: int = STEP_REPEATS) -> float:
    """The coefficient of variation of a whole step's compute on one rank: the reference GPT
    chain (``_chain``, ~50 ms of forward and backward, a step's worth) run ``least`` times or
    more, std / mean of the repeats' totals. A rank's work per step varies as a whole (the
    machine, not one action); replicas that meet once a step wait for the slowest
    (``plan.here``'s replica term)."""
    totals: list = []
    gpt_units(*REF["gpt"], budget, totals, least)
    return float(np.std(totals) / np.mean(totals)) if len(totals) > 1 else 0.0


def measure_units(quick: bool, cache_bytes: float = 0.0) -> dict:
    """{"floor_<unit>_<phase>": s, "ref_<unit>_<phase>": s, "opt_tensor": s, "opt_value": s}
    (seconds), and the warm OPT costs with ``cache_bytes`` (``optimizer_costs``)."""
    budget = 0.05 if quick else 0.4
    out = optimizer_costs(budget, cache_bytes)
    out["step_cv"] = step_cv(budget, 4 if quick else STEP_REPEATS)
    return out | unit_times(budget)


def unit_times(budget: float) -> dict:
    """{"floor_<unit>_<phase>": s, "ref_<unit>_<phase>": s, "floor_loss_f": s, ...,
    "shape<i>_<unit>_<phase>": s}: every unit chain at the tiny and the reference shape, and
    the GPT units at each of ``SHAPES`` (i from 1), with the reference shape and the tiny one
    timed again among them (``shape0``, ``shapefloor``: the fit's own floor, ``plan.unit_fit``);
    ``plan.resample`` re-times these beside the runs."""
    out = {}
    for tag, shapes in (("floor", FLOOR), ("ref", REF)):
        got = gpt_units(*shapes["gpt"], budget) | mlp_units(*shapes["mlp"], budget)
        out.update({f"{tag}_{k}": v for k, v in got.items()})
    for i, shape in [("floor", FLOOR["gpt"])] + list(enumerate((REF["gpt"], *SHAPES))):
        out.update({f"shape{i}_{k}": v for k, v in gpt_units(*shape, budget).items()})
    return out
