"""A model unit's phase time from its counted work and the spec's measured unit times.

``plan.here.unit_costs`` counts, per unit and micro-batch, three kinds of work in seconds at the
spec's rates: GEMM time (FLOPs over the fitted square-GEMM curve at the GEMM's smallest side),
the attention core's GEMM time (batched per head, its smallest side the head size) and
element-wise time (bytes over the element-wise rate). What a phase of mpipar's own unit costs
is not that sum: the backward's transposed and strided products run slower than the square
curve, LayerNorm, GELU and softmax gradients move more than the bytes counted, and each call
pays its dispatch. So a phase is

    floor + a x GEMM + c x core GEMM + k x element-wise

with ``floor`` the unit's time at the tiny shape (``[units] floor_*``) and (a, c, k) the
weights that make the measured shapes come out: with the reference shape alone (``ref_*``)
a = c = 1 and ``k`` solves that one shape. One shape cannot tell a GEMM's excess from the
element-wise one, and they grow differently with the width (a GEMM as T d^2, element-wise work
as T d), so a single ``k`` priced the 64-wide tiny GPT's blocks and head 10-25 % long and the
128-wide one's about right. ``mpipar plan measure`` therefore also times the GPT units at a few
more shapes (``unit_bench.SHAPES``: other widths, head sizes and sequence lengths, fixed there,
never a validation run's), and (a, c, k) are the non-negative least-squares fit over all the
shapes, each weighed by its own time (relative error).

``plan.here.planned`` prices units by the single-shape rule and shows the fit beside it
(``with_shapes``; ``experiments/plan_here.py``'s ``shapes_ms``): on this machine's stored
runs the fit priced the tiny GPT's backward and head 5-10 % lower and the 8-block GPT's units
4-7 % higher, and the runs were then 10-15 % faster than the samples at both sizes (the
samples' level, not the form), so the column waits for quiet runs to decide.

The shapes' level: the machine drifts (``plan.resample``), and a sample taken beside the runs
may re-time the floor and the reference shape without the other shapes (older samples). So
(a, c, k) are fitted over the shapes against the floor timed with them (``shapefloor_*``; the
reference shape is among them again as ``shape0_*``), then scaled so that the reference shape
comes out as ``ref_*`` says, as the single-shape rule does: the shapes give the form, the
reference shape measured now its level.
"""

from __future__ import annotations

import itertools

import numpy as np

# without a measured [units] section (the bundled GPU specs): no floor, the backward-input's
# element-wise traffic twice the forward's, none in the weight pass (``costs.layer_cost``'s rule)
DEFAULT_K = {"f": 1.0, "b": 2.0, "w": 0.0}


def phase_parts(u: dict) -> dict:
    """{phase: (GEMM s, core GEMM s, element-wise s)} of a unit: the backward-input redoes the
    forward's GEMMs (attention core included), the weight pass only the weights' GEMMs."""
    mem = u["mem"] + u["core_mem"]
    return {"f": (u["gemm"], u["core_gemm"], mem), "b": (u["gemm"], u["core_gemm"], mem),
            "w": (u["gemm"], 0.0, u["mem"])}


def fit_weights(rows: list[tuple], floor: float) -> tuple[float, float, float]:
    """(a, c, k) >= 0 minimising the relative error of ``floor + a g + c h + k m`` against
    each row's measured ``y``; ``rows``: [(g, h, m, y)]. One row: a = c = 1, ``k`` solves it
    (0 when the counted parts already pass it). Several: the least-squares fit over every
    subset of the parts present whose weights all come out non-negative, the smallest
    residual kept (three parts at most: the subsets are few)."""
    g, h, m, y = (np.array(col, float) for col in zip(*rows, strict=True))
    if len(rows) == 1:
        k = max(y[0] - floor - g[0] - h[0], 0.0) / m[0] if m[0] > 0 else 0.0
        return 1.0, 1.0, float(k)
    X, w = np.stack([g, h, m], axis=1), 1.0 / y
    present = [j for j in range(3) if X[:, j].any()]
    best = None
    for r in range(1, len(present) + 1):
        for sub in itertools.combinations(present, r):
            coef, *_ = np.linalg.lstsq(X[:, sub] * w[:, None], (y - floor) * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(sub)] = coef
            res = float(np.sum(((floor + X @ full - y) * w) ** 2))
            if best is None or res < best[0]:
                best = (res, full)
    if best is None:  # nothing non-negative (every shape under its floor): the floor alone
        return 0.0, 0.0, 0.0
    return tuple(float(x) for x in best[1])


def _ref_configs(shapes: dict) -> dict:
    d, heads, seq, b = shapes["gpt"]
    width, rows = shapes["mlp"]
    return {"gpt": _gpt_config(d, heads, seq, b),
            "mlp": {"model": {"kind": "mlp", "sizes": [width, width, width]},
                    "train": {"batch_size": rows, "dtype": "float32"}}}


def _gpt_config(d: int, heads: int, seq: int, b: int) -> dict:
    return {"model": {"kind": "gpt", "vocab_size": 256, "block_size": seq, "n_layer": 1,
                      "n_embd": d, "n_head": heads},
            "train": {"batch_size": b, "seq_len": seq, "dtype": "float32"}}


def _parts_by_kind(cfg: dict, c, unit_costs) -> dict:
    out = {}
    for u in unit_costs(cfg, {"dp": 1, "pp": 1, "tp": 1}, c):
        out.setdefault(u["kind"], u)
    return out


def calibration(c, unit_costs) -> dict:
    """{(unit kind, phase): (floor s, (a, c, k))} from the spec's ``[units]``
    (``plan.unit_bench``; module doc), and {("loss", phase): (floor s, (0, 0, 0))} for the
    MLP's loss; {} without that section. ``unit_costs``: ``plan.here.unit_costs`` (passed
    in: ``here`` imports this module)."""
    from .unit_bench import REF, SHAPES

    got = dict(c.units)
    if not got:
        return {}
    ref = {}
    for cfg in _ref_configs(REF).values():
        ref |= _parts_by_kind(cfg, c, unit_costs)
    others = [(i, _parts_by_kind(_gpt_config(*shape), c, unit_costs))
              for i, shape in enumerate((REF["gpt"], *SHAPES))
              if any(k.startswith(f"shape{i}_") for k in got)]
    out = {}
    for kind, u in ref.items():
        for ph, parts in phase_parts(u).items():
            measured = got.get(f"ref_{kind}_{ph}")
            if measured is None:
                continue
            floor = got.get(f"floor_{kind}_{ph}", 0.0)
            out[(kind, ph)] = (floor, _weights(got, kind, ph, others, parts, measured, floor))
    for ph in ("f", "b"):  # the MLP's loss: a per-call cost at its sizes (unit_bench)
        if f"floor_loss_{ph}" in got:
            out[("loss", ph)] = (got[f"floor_loss_{ph}"], (0.0, 0.0, 0.0))
    return out


def _weights(got: dict, kind: str, ph: str, shapes: list, parts: tuple, measured: float,
             floor: float) -> tuple[float, float, float]:
    """(a, c, k) of one unit kind and phase: the single-shape rule without the shapes; with
    them, the fit over the shapes against the floor timed with them (``shapefloor``), scaled
    so that the reference shape comes out as ``ref_`` (module doc)."""
    rows = [(*phase_parts(units[kind])[ph], got[f"shape{i}_{kind}_{ph}"])
            for i, units in shapes if f"shape{i}_{kind}_{ph}" in got and kind in units]
    if len(rows) < 2:
        return fit_weights([(*parts, measured)], floor)
    a, c, k = fit_weights(rows, got.get(f"shapefloor_{kind}_{ph}", floor))
    at_ref = a * parts[0] + c * parts[1] + k * parts[2]
    if at_ref <= 0:
        return fit_weights([(*parts, measured)], floor)
    scale = max(measured - floor, 0.0) / at_ref
    return a * scale, c * scale, k * scale


def one_shape(c):
    """The spec ``c`` without its other shapes' times: its units priced by the single-shape
    rule (the column beside the plan that shows what the shapes change)."""
    import dataclasses

    return dataclasses.replace(c, units=tuple((k, v) for k, v in c.units
                                              if not k.startswith("shape")))


def phase_times(u: dict, cal: dict, recompute: str) -> tuple[float, float, float]:
    """(F, B, W) of one unit: floor + a GEMM + c core GEMM + k element-wise per phase, tp
    collectives in F and B, recomputation in B (full: the forward again; selective: the
    attention core's GEMM and element-wise work at the forward's weights)."""
    t = {}
    for ph, (gemm, core, mem) in phase_parts(u).items():
        floor, (a, c, k) = cal.get((u["kind"], ph), (0.0, (1.0, 1.0, DEFAULT_K[ph])))
        t[ph] = floor + a * gemm + c * core + k * mem
        if u.get("loss") and ph in "fb":  # the MLP's last unit also runs the loss
            t[ph] += cal.get(("loss", ph), (0.0, None))[0]
    f, b = t["f"] + u["tp_f"], t["b"] + u["tp_b"]
    if recompute == "full":
        b += f
    elif recompute == "selective":
        _, (_, c, k) = cal.get((u["kind"], "f"), (0.0, (1.0, 1.0, 1.0)))
        b += c * u["core_gemm"] + k * u["core_mem"]
    return f, b, t["w"]
