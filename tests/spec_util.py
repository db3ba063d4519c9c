"""A small cluster spec in the bundled TOML schema, for the planner's tests: every number a
test does not name is a round one, so a test states only what it depends on."""

from __future__ import annotations


def spec_text(*, name: str = "test", gpus_per_node: int = 4, workspace_gb: float = 0.1,
              fp32: float = 0.05, hbm_gbs: float = 10.0, intra=(10.0, 5.0), inter=(1.0, 50.0),
              half_dim: float = 16.0, top: str = "") -> str:
    """The spec's text; ``intra`` / ``inter``: (bandwidth GB/s, latency us); ``top``: extra
    top-level lines (``cores_per_node = 2``), which TOML needs before the first table."""
    return f"""name = "{name}"
gpus_per_node = {gpus_per_node}
{top}workspace_gb = {workspace_gb}
[peak_tflops]
fp32 = {fp32}
[hbm]
capacity_gb = 16.0
bandwidth_gbs = {hbm_gbs}
efficiency = 1.0
[intra_node]
bandwidth_gbs = {intra[0]}
latency_us = {intra[1]}
efficiency = 1.0
[inter_node]
bandwidth_gbs = {inter[0]}
latency_us = {inter[1]}
efficiency = 1.0
[gemm]
sms = 1
tile_rows = 1
tile_cols = 1
max_efficiency = 1.0
half_dim = {half_dim}
"""
