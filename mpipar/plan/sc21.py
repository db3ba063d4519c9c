"""Megatron-LM SC'21 Table 1 (the planner's validation data) and the planner's prediction of it."""

from __future__ import annotations

import csv
from importlib import resources

from .cluster import load_cluster, peak_flops
from .evaluate import Config, evaluate
from .model import GPTShape, megatron_sc21_flops
from .search import plan

DTYPE = "fp16"  # the SC'21 runs (examples/sc21/run_table_1.sh) and Korthikanti et al. 2022


def read_table(name: str) -> list[dict]:
    """A CSV of ``mpipar/plan/data`` ('#' lines are its source notes); numbers parsed."""
    text = (resources.files("mpipar.plan") / "data" / name).read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        out = {}
        for k, v in r.items():
            try:
                out[k] = int(v)
            except ValueError:
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v if v != "" else None
        rows.append(out)
    return rows


def table1() -> list[dict]:
    rows = read_table("sc21_table1.csv")
    for r in rows:
        r["params_b"] = float(r["params_b"])
    return rows


def shape(row: dict) -> GPTShape:
    return GPTShape(layers=row["layers"], hidden=row["hidden"], heads=row["heads"], seq=2048,
                    vocab=51200, name=f"gpt-{row['params_b']}b")


def paper_fix(row: dict) -> dict:
    """The published configuration as ``--fix`` settings (no SP, no ZeRO-1 in 2021; the DP
    all-reduce ran after the backward, not overlapped with it; Megatron-LM's rank order)."""
    return {"dp": row["gpus"] // (row["tp"] * row["pp"]), "pp": row["pp"], "tp": row["tp"],
            "schedule": row["schedule"], "v": row["v"], "microbatch_size": row["microbatch_size"],
            "recompute": row["recompute"], "sp": False, "zero1": False, "dp_overlap": False,
            "placement": "tp-dp-pp"}


def paper_row(row: dict, cluster) -> dict:
    """The planner's row for the paper's configuration straight from ``evaluate`` (fast: the
    fit calls it thousands of times); the same numbers as ``predict``'s ``plan --fix`` path."""
    m = shape(row)
    got = evaluate(m, cluster, peak_flops(cluster, DTYPE), DTYPE, row["batch"],
                   Config(**paper_fix(row)))
    got["paper_tflops"] = megatron_sc21_flops(m, row["batch"]) / got["step_time_s"] \
        / row["gpus"] / 1e12
    return got


def predict(row: dict, cluster=None) -> dict:
    """The planner's row for the paper's configuration, with TFLOP/s by the paper's formula."""
    c = cluster or load_cluster("dgx-a100-80gb")
    m = shape(row)
    got = plan(m, c, row["gpus"], row["batch"], DTYPE, fixed=paper_fix(row), top=1)[0]
    flops = megatron_sc21_flops(m, row["batch"])
    got["paper_tflops"] = flops / got["step_time_s"] / row["gpus"] / 1e12
    return got
