"""Korthikanti et al. 2022 (arXiv 2205.05198): a second published table, predicted with the
A100 constants frozen (fitted on SC'21 Table 1 only; nothing here is fitted).

Each row is one model at its published configuration (dp = 1), in two modes: full
recomputation without sequence parallelism ("full"), and sequence parallelism plus selective
recomputation of the attention core ("seqsel"). Data: ``mpipar/plan/data/korthikanti2022.csv``.
"""

from __future__ import annotations

from .cluster import load_cluster
from .model import GPTShape, model_flops_per_step
from .sc21 import DTYPE, read_table
from .search import plan


def table() -> list[dict]:
    return read_table("korthikanti2022.csv")


def shape(row: dict) -> GPTShape:
    return GPTShape(layers=row["layers"], hidden=row["hidden"], heads=row["heads"], seq=2048,
                    vocab=51200, name=row["model"])


def paper_fix(row: dict) -> dict:
    seqsel = row["mode"] == "seqsel"
    fix = {"dp": row["gpus"] // (row["tp"] * row["pp"]), "pp": row["pp"], "tp": row["tp"],
           "schedule": "interleaved" if row["v"] > 1 else "1f1b", "v": row["v"],
           "microbatch_size": row["microbatch_size"],
           "recompute": "selective" if seqsel else "full", "sp": seqsel, "zero1": False,
           "dp_overlap": False, "placement": "tp-dp-pp"}
    return fix


def predict(row: dict, cluster=None) -> dict:
    """The planner's row for the published configuration, plus the published iteration time's
    MFU (model FLOPs, 72 B s l h^2 (1 + s/6h + V/12lh), over 312 TFLOP/s) for comparison."""
    c = cluster or load_cluster("dgx-a100-80gb")
    m = shape(row)
    got = plan(m, c, row["gpus"], row["batch"], DTYPE, fixed=paper_fix(row), top=1)[0]
    model = model_flops_per_step(m, row["batch"])
    got["published_mfu"] = model / row["iteration_s"] / row["gpus"] / c.peak[DTYPE]
    got["error"] = got["step_time_s"] / row["iteration_s"] - 1
    return got
