"""Checks of the planner's model against SC'21's Figures 11-18 (orderings and bounds its text
states) and its Table 2 (published TFLOP/s); data: ``experiments/data/sc21_figures.toml``, which
says where each comes from.

A configuration is written ``tp=8,pp=8,mbs=2,schedule=interleaved,v=4,recompute=none,
scatter_gather=0``; dp is what is left of the GPUs. Unless written, as the paper's scripts ran
them: 1F1B, micro-batch 1, full recomputation, scatter/gather on, no SP, no ZeRO-1, the DP
all-reduce after the backward, Megatron-LM's rank order. Throughput is the paper's: its FLOP
count over the step time.
"""

from __future__ import annotations

from pathlib import Path

import tomllib

from .cluster import Cluster, peak_flops
from .evaluate import Config, evaluate
from .model import GPTShape, megatron_sc21_flops
from .sc21 import DTYPE

DEFAULTS = {"schedule": "1f1b", "v": 1, "microbatch_size": 1, "recompute": "full", "sp": False,
            "zero1": False, "dp_overlap": False, "scatter_gather": True,
            "placement": "tp-dp-pp"}
_INT = ("tp", "pp", "v", "microbatch_size")


def parse(text: str, gpus: int) -> Config:
    fields = dict(DEFAULTS)
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = "microbatch_size" if key == "mbs" else key
        if key in _INT:
            fields[key] = int(value)
        elif key == "scatter_gather":
            fields[key] = value not in ("0", "false", "off")
        else:
            fields[key] = value
    fields["dp"] = gpus // (fields["tp"] * fields["pp"])
    return Config(**fields)


def throughput(check: dict, text: str, c: Cluster, batch: int | None = None) -> dict:
    """The row of one configuration; ``layers=N`` and ``gpus=N`` in ``text`` override the
    check's (Figure 11 grows the model and the GPUs with pp)."""
    layers, hidden, heads = check["model"]
    gpus, items = check["gpus"], []
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key == "layers":
            layers = int(value)
        elif key == "gpus":
            gpus = int(value)
        else:
            items.append(item)
    m = GPTShape(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    batch = batch or check["batch"]
    row = evaluate(m, c, peak_flops(c, DTYPE), DTYPE, batch, parse(",".join(items), gpus))
    row["paper_tflops"] = megatron_sc21_flops(m, batch) / row["step_time_s"] / gpus / 1e12
    return row


def _gain(check, c, batch=None) -> float:
    a = throughput(check, check["a"], c, batch)["paper_tflops"]
    return a / throughput(check, check["b"], c, batch)["paper_tflops"] - 1


def run_check(check: dict, c: Cluster) -> tuple[bool, str]:
    """(holds, what the model predicts) for one check."""
    kind = check["kind"]
    if kind in ("best", "decreasing"):
        tp = [throughput(check, s, c)["paper_tflops"] for s in check["series"]]
        shown = ", ".join(f"{s}: {x:.1f}" for s, x in zip(check["series"], tp))
        if kind == "best":
            got = tp[check["series"].index(check["expect"])]
            return got >= max(tp) * (1 - check["tol"]), shown
        ok = all(b <= a * (1 + check["tol"]) for a, b in zip(tp, tp[1:]))
        return ok, shown
    if kind == "gain":
        g = _gain(check, c)
        return check["lo"] <= g <= check["hi"], f"{100 * g:+.1f}%"
    if kind == "shrinks":
        first, last = (_gain(check, c, b) for b in check["batches"])
        return first >= last, f"{100 * first:+.1f}% -> {100 * last:+.1f}%"
    if kind == "value":  # a published number: TFLOP/s per GPU within tol
        got = throughput(check, check["a"], c)["paper_tflops"]
        err = got / check["published"] - 1
        return abs(err) <= check["tol"], f"{got:.1f} vs {check['published']} ({100 * err:+.1f}%)"
    if kind == "no_fit":
        row = throughput(check, check["a"], c)
        return not row["fits"], f"{row['memory_gib']:.1f} GiB"
    raise ValueError(f"unknown check kind {kind!r}")


def load_checks(path: str | Path) -> list[dict]:
    return tomllib.loads(Path(path).read_text())["check"]
