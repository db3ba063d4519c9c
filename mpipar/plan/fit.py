"""Fit the two hardware constants of a cluster's GEMM curve on published runs, and test the fit
out of sample (leave-one-out): the constants are a property of the GPU, not of a row.

The curve is ``max_efficiency * g / (g + half_dim)`` (``Cluster.gemm_efficiency``). The fit is a
grid search minimising the squared log error of predicted against published TFLOP/s; every
(grid point, row) error is computed once, so leave-one-out costs no more than one fit.
"""

from __future__ import annotations

import dataclasses
import math

from .sc21 import paper_row

GRID_EFF = tuple(round(0.50 + 0.005 * i, 3) for i in range(91))  # 0.50 ... 0.95
GRID_HALF = (8.0, 12.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0, 64.0, 80.0, 96.0, 128.0, 160.0,
             192.0, 256.0, 384.0, 512.0)


def log_errors(cluster, rows: list[dict]) -> dict[tuple[float, float], list[float]]:
    """log(predicted / published TFLOP/s) of every row at every grid point."""
    out = {}
    for eff in GRID_EFF:
        for half in GRID_HALF:
            c = dataclasses.replace(cluster, gemm_max_efficiency=eff, gemm_half_dim=half)
            out[eff, half] = [math.log(paper_row(r, c)["paper_tflops"] / r["tflops"])
                              for r in rows]
    return out


def best(errors: dict, keep: list[int]) -> tuple[float, float, float]:
    """(max_efficiency, half_dim, rms log error) over the rows whose indices are in ``keep``."""
    score = {k: sum(e[i] ** 2 for i in keep) for k, e in errors.items()}
    eff, half = min(score, key=lambda k: (score[k], k))
    return eff, half, math.sqrt(score[eff, half] / len(keep))


def fit(cluster, rows: list[dict], errors: dict | None = None):
    """The constants fitted on all ``rows``: (max_efficiency, half_dim, rms log error)."""
    errors = errors or log_errors(cluster, rows)
    return best(errors, list(range(len(rows))))


def leave_one_out(cluster, rows: list[dict], errors: dict | None = None) -> list[dict]:
    """For each row: the constants fitted on the other rows and its prediction with them."""
    errors = errors or log_errors(cluster, rows)
    out = []
    for i, row in enumerate(rows):
        eff, half, rms = best(errors, [j for j in range(len(rows)) if j != i])
        c = dataclasses.replace(cluster, gemm_max_efficiency=eff, gemm_half_dim=half)
        got = paper_row(row, c)["paper_tflops"]
        out.append({"row": row, "max_efficiency": eff, "half_dim": half, "fit_rms": rms,
                    "predicted": got, "error": got / row["tflops"] - 1})
    return out
