"""Megatron-LM SC'21 Table 1 (the planner's validation data) and the planner's prediction of it."""

from __future__ import annotations

import csv
from importlib import resources

from .cluster import load_cluster
from .model import GPTShape, megatron_sc21_flops
from .search import plan


def table1() -> list[dict]:
    text = (resources.files("mpipar.plan") / "data" / "sc21_table1.csv").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        rows.append({k: (v if k in ("schedule", "recompute") else
                         float(v) if "." in v or k in ("params_b", "tflops", "pct_peak") else
                         int(v)) for k, v in r.items()})
    return rows


def shape(row: dict) -> GPTShape:
    return GPTShape(layers=row["layers"], hidden=row["hidden"], heads=row["heads"], seq=2048,
                    vocab=51200, name=f"gpt-{row['params_b']}b")


def paper_fix(row: dict) -> dict:
    """The published configuration as ``--fix`` settings (no SP, no ZeRO-1 in 2021)."""
    return {"dp": row["gpus"] // (row["tp"] * row["pp"]), "pp": row["pp"], "tp": row["tp"],
            "schedule": row["schedule"], "v": row["v"], "microbatch_size": row["microbatch_size"],
            "recompute": row["recompute"], "sp": False, "zero1": False}


def predict(row: dict, cluster=None) -> dict:
    """The planner's row for the paper's configuration, with TFLOP/s by the paper's formula."""
    c = cluster or load_cluster("dgx-a100-80gb")
    m = shape(row)
    got = plan(m, c, row["gpus"], row["batch"], fixed=paper_fix(row), top=1)[0]
    flops = megatron_sc21_flops(m, row["batch"])
    got["paper_tflops"] = flops / got["step_time_s"] / row["gpus"] / 1e12
    return got
