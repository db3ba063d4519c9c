"""Several runs side by side, and turning results into JSON or a DataFrame."""

from __future__ import annotations

import math

import numpy as np

from .breakdown import breakdown
from .dump import load

COMPARE_COLUMNS = (
    "run",
    "world_size",
    "dp",
    "pp",
    "tp",
    "schedule",
    "microbatches",
    "virtual_stages",
    "step_time",
    "tokens_per_s",
    "flops_per_s",
    "mfu",
    "compute_frac",
    "exposed_frac",
    "idle_frac",
    "bubble",
    "bubble_pipeline",
    "bubble_sim",
    "bubble_textbook",
)


def compare(results: list) -> dict:
    """One row per run (breakdown dicts, Runs or paths): a table {column: np.ndarray}."""
    rows = [r if isinstance(r, dict) else breakdown(r) for r in results]
    table = {}
    for c in COMPARE_COLUMNS:
        vals = [row["summary"].get(c) for row in rows]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        table[c] = np.array(vals, dtype=float if numeric else object)
    return table


def summarize(path, step: int | None = None, peak: float | None = None) -> dict:
    """A plain (JSON-ready) dict of one dump's breakdown: for tests and scripts."""
    result = breakdown(load(path), step=step, peak=peak)
    return to_jsonable(result)


def to_jsonable(obj):
    """numpy -> Python, NaN -> None, recursively."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [to_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def to_dataframe(table: dict):
    """A pandas DataFrame of a table (``result["ranks"]``, ``compare(...)``); needs pandas."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "to_dataframe needs pandas (pip install pandas); the dict of arrays works without"
        ) from None
    return pd.DataFrame({k: list(v) for k, v in table.items()})
