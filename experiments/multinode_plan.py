"""Planned columns of experiments/multinode.py's training rows: the planner's step beside each
measured one, from a spec of this machine and a spec of the emulated cluster derived from it.

The emulated cluster's spec (``emulated``) is the machine's spec (``mpipar plan measure --out
FILE``: GEMM rate, units, executor, links inside a node) with two changes:

- ``[inter_node]``: bandwidth the link's configured rate (tbf shapes it to that rate), latency
  the one-way time of the smallest message the p2p rows of the same run measured across the link
  at that rate (the spec's own ``[inter_node]`` latency where that rate had no p2p rows);
- ``cores_per_node``: the machine's cores over the nodes, since the emulated nodes share the
  machine's cores (a row on one node keeps the machine's spec unchanged);
- ``nics_per_node`` 1: a node has one link, shared by its ranks that cross at once
  (``mpipar.plan.placement``).

Each row is planned with ``mpipar.plan.here.planned`` on the run's own config and grid (its
``parallel.order`` included) and its ranks per node, so ``mpipar.plan.placement`` puts the
axes whose groups cross nodes on ``[inter_node]``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from mpipar.cluster.spec import parse_rate
from mpipar.plan.cluster import Cluster, Link, load_cluster
from mpipar.plan.here import SPEC_ENV, planned


def base_spec(path: str | None) -> Cluster | None:
    """The machine's spec: ``--spec``, else ``$MPIPAR_SPEC``; None without either."""
    path = path or os.environ.get(SPEC_ENV)
    return load_cluster(path) if path else None


def p2p_latencies(results: dict[str, dict]) -> dict[str, float]:
    """{rate: one-way seconds of the smallest message across the link} from the p2p rows."""
    out = {}
    for label, res in results.items():
        if label.startswith("link-") and res.get("rows"):
            small = min(res["rows"], key=lambda r: r["bytes"])
            out[label[5:]] = float(small["median_s"])
    return out


def emulated(base: Cluster, rate: str, latency: float | None, nodes: int) -> Cluster:
    """The spec of ``nodes`` emulated nodes joined by a ``rate`` link (module doc)."""
    inter = Link(bandwidth=parse_rate(rate) / 8, latency=latency or base.inter.latency,
                 efficiency=1.0)
    cores = base.cores_per_node / nodes if base.cores_per_node > 0 else base.cores_per_node
    return dataclasses.replace(base, name=f"{base.name}+{nodes}x@{rate}", inter=inter,
                               cores_per_node=cores, nics_per_node=1)


def planned_ms(run_dir: Path, cluster: Cluster, ranks_per_node: int | None) -> float:
    """The planned step (ms) of the run dumped in ``run_dir``, on ``cluster``."""
    from mpipar.analysis import load

    run = load(run_dir / "trace.h5")
    return round(planned(run.config, run.grid, cluster, ranks_per_node)["step"] * 1e3, 2)


def differences(rows: list[dict]) -> list[dict]:
    """Per rate: tp-across minus tp-inside, measured and planned (ms per step)."""
    by = {r["run"]: r for r in rows}
    out = []
    for r in rows:
        if not r["run"].startswith("tp-inside@"):
            continue
        rate = r["rate"]
        across = by.get(f"tp-across@{rate}")
        if across is None:
            continue
        row = {"rate": rate,
               "measured across - inside ms": round(across["step ms"] - r["step ms"], 2)}
        if "planned ms" in r and "planned ms" in across:
            row["planned across - inside ms"] = round(across["planned ms"] - r["planned ms"], 2)
        out.append(row)
    return out
