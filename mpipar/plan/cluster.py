"""Cluster specs: per-GPU peaks, HBM, links, and the fitted achievable-efficiency constants.

Bundled specs live in ``mpipar/plan/clusters/<name>.toml``; each number there says where it comes
from. A spec is a property of the hardware only: nothing in it depends on a model or a config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import tomllib

from .errors import PlanError

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}  # activation / weight bytes of each training dtype


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per GPU per direction
    latency: float  # seconds per collective or transfer
    efficiency: float  # achievable fraction of bandwidth

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / (self.bandwidth * self.efficiency)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    peak: dict  # dtype -> FLOP/s per GPU (dense)
    hbm_capacity: float  # bytes
    hbm_bandwidth: float  # bytes/s
    hbm_efficiency: float
    intra: Link
    inter: Link
    gemm_max_efficiency: float
    gemm_half_dim: float  # smallest GEMM dimension at which half of max_efficiency is reached
    workspace: float  # bytes per GPU reserved (CUDA context, NCCL buffers, fragmentation)
    sms: int = 108  # streaming multiprocessors: one output tile each per wave
    tile: tuple[int, int] = (256, 128)  # a large GEMM's output tile (rows, columns)
    # measured specs only (``mpipar plan measure``): the collective link, the executor's own
    # costs in seconds (action_overhead, send_post, recv_post, sync, step_pre, step_post)
    collective: Link | None = None
    executor: tuple = ()
    cores_per_rank: float = 0.0
    cores_per_node: int = 0  # CPU specs: ranks beyond it share cores (0: no such term)
    units: tuple = ()  # measured model-unit times, seconds (``plan.unit_bench``)
    runtime: float = 0.0  # bytes a rank's runtime touches during the steps (plan.memory_terms)
    cache: float = 0.0  # bytes of a core's own cache (CPU specs; plan.here's optimizer costs)
    step_cv: float = 0.0  # a rank's compute per step: std / mean (plan.replicas)
    shared_slowdown: float = 1.0  # ranks beyond the cores: compute this much slower (oversub)
    # links out of a node ([inter_node] nics_per_node); 0: one per GPU, as the bundled DGX
    # specs have. A node's ranks beyond it share one (``placement.axis_links``)
    nics_per_node: int = 0

    def gemm_efficiency(self, smallest_dim: float) -> float:
        """Achievable fraction of peak for a GEMM whose smallest dimension per GPU is given:
        rises with the size and saturates (tile quantisation and launch overheads shrink)."""
        return self.gemm_max_efficiency * smallest_dim / (smallest_dim + self.gemm_half_dim)

    def wave_efficiency(self, rows: float, cols: float, batch: float = 1) -> float:
        """Fraction of the last wave's SMs that have work: a GEMM with an M x N output (times
        ``batch``) runs ceil(M/tm) ceil(N/tn) tiles in waves of ``sms``; a partial last wave
        costs a whole one (NVIDIA's "wave quantization"). No fitted number: SM count and tile."""
        tiles = batch * math.ceil(rows / self.tile[0]) * math.ceil(cols / self.tile[1])
        return tiles / (self.sms * math.ceil(tiles / self.sms))

    def hbm_time(self, nbytes: float) -> float:
        return nbytes / (self.hbm_bandwidth * self.hbm_efficiency)


def bundled() -> list[str]:
    folder = resources.files("mpipar.plan") / "clusters"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def _get(data: dict, path: str, where: str):
    node = data
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise PlanError(f"{where}: cluster spec misses {path!r}")
        node = node[key]
    if path.startswith("peak_tflops"):
        return node
    if not isinstance(node, (int, float)) or node <= 0:
        raise PlanError(f"{where}: {path} must be a positive number, got {node!r}")
    return float(node)


def _link(data: dict, section: str, where: str) -> Link:
    return Link(
        bandwidth=_get(data, f"{section}.bandwidth_gbs", where) * 1e9,
        latency=_get(data, f"{section}.latency_us", where) * 1e-6,
        efficiency=_get(data, f"{section}.efficiency", where),
    )


def _nics(data: dict, where: str) -> int:
    n = data.get("inter_node", {}).get("nics_per_node", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PlanError(f"{where}: inter_node.nics_per_node must be a whole number >= 0 (0: one "
                        f"link per GPU), got {n!r}")
    return n


def load_cluster(spec: str) -> Cluster:
    """A bundled name (``dgx-a100-80gb``, ``dgx-h100``, ``h200``) or a TOML file path."""
    if spec in bundled():
        text = (resources.files("mpipar.plan") / "clusters" / f"{spec}.toml").read_text()
        where = spec
    elif Path(spec).is_file():
        text, where = Path(spec).read_text(), spec
    else:
        raise PlanError(
            f"--cluster {spec!r} is neither a bundled spec nor a file; bundled: "
            f"{', '.join(bundled())}"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{where}: not valid TOML: {exc}") from exc
    peaks = _get(data, "peak_tflops", where)
    if not isinstance(peaks, dict) or not peaks:
        raise PlanError(f"{where}: [peak_tflops] needs at least one dtype = TFLOP/s")
    return Cluster(
        name=str(data.get("name", Path(where).stem)),
        gpus_per_node=int(_get(data, "gpus_per_node", where)),
        peak={k: float(v) * 1e12 for k, v in peaks.items()},
        hbm_capacity=_get(data, "hbm.capacity_gb", where) * 1e9,
        hbm_bandwidth=_get(data, "hbm.bandwidth_gbs", where) * 1e9,
        hbm_efficiency=_get(data, "hbm.efficiency", where),
        intra=_link(data, "intra_node", where),
        inter=_link(data, "inter_node", where),
        gemm_max_efficiency=_get(data, "gemm.max_efficiency", where),
        gemm_half_dim=_get(data, "gemm.half_dim", where),
        workspace=_get(data, "workspace_gb", where) * 1e9,
        sms=int(_get(data, "gemm.sms", where)),
        tile=(int(_get(data, "gemm.tile_rows", where)), int(_get(data, "gemm.tile_cols", where))),
        collective=_link(data, "collective", where) if "collective" in data else None,
        executor=tuple(sorted((k.removesuffix("_us"), _get(data, f"executor.{k}", where) * 1e-6)
                              for k in data.get("executor", {}))),
        cores_per_rank=float(data.get("cores_per_rank", 0.0)),
        cores_per_node=int(data.get("cores_per_node", 0)),
        runtime=float(data.get("runtime_mb", 0.0)) * 2**20,
        cache=float(data.get("cache_mb", 0.0)) * 2**20,
        step_cv=float(data.get("step_cv", 0.0)),
        shared_slowdown=max(float(data.get("shared_slowdown", 1.0)), 1.0),
        nics_per_node=_nics(data, where),
        units=tuple(sorted((k.removesuffix("_us"), _get(data, f"units.{k}", where) * 1e-6)
                           for k in data.get("units", {}))),
    )


def peak_flops(cluster: Cluster, dtype: str) -> float:
    if dtype not in DTYPES:
        raise PlanError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    if dtype not in cluster.peak:
        raise PlanError(
            f"cluster {cluster.name} gives no peak for {dtype}; it has {', '.join(cluster.peak)}"
        )
    return cluster.peak[dtype]
