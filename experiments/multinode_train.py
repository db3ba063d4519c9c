"""Training rows of experiments/multinode.py: where a tp group sits, one node or two for dp.

Each row is a short `mpipar train` run of the tiny GPT (experiments/configs/tiny.toml) on an
emulated cluster (`mpipar cluster`), its dump analysed:

- ``tp-inside@RATE`` / ``tp-across@RATE``: dp=2 x tp=2 on 2 nodes x 2 ranks, with
  ``parallel.order=tp-dp-pp`` (each tp pair on one node, the dp pairs across the link) or
  ``dp-tp-pp`` (the dp pairs on one node, each tp pair across the link);
- ``dp-1node``: dp=2 on one node x 2 ranks (no link in the way: measured once);
- ``dp-2nodes@RATE``: dp=2 on 2 nodes x 1 rank.

Per row: mean step time (``mpipar analyze``'s, warm-up step excluded), each axis's bytes per
step within a node and across nodes (the links table: ``mpipar.analysis.links``) and the
data-parallel bucket wait per rank and step (time blocked in ``dp.wait``: the part of the
gradient all-reduce the backward did not hide). With a spec of this machine (``--spec`` or
``$MPIPAR_SPEC``): each row's planned step beside the measured one, and per rate the
tp-across minus tp-inside difference, measured and planned (experiments/multinode_plan.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import common
import multinode_plan
import numpy as np

from mpipar.cluster import nodes
from mpipar.cluster.spec import ClusterSpec

NAME = "mnxt"
RATES = "10gbit,200mbit"
QUICK_RATES = "1gbit"
STEPS, QUICK_STEPS = 10, 3
QUICK_MODEL = ["--seq-len", "16", "--batch-size", "8", "--set", "model.block_size=16"]
AXES = ("dp", "tp")  # every row has pp = 1


def token_file(out: Path) -> Path:
    from mpipar.datasets import prepare_synthetic

    path = out / "tokens.h5"
    if not path.exists():
        prepare_synthetic(path, "pattern", 20000, 256, seed=1)
    return path


def analyse(run_dir: Path) -> dict:
    """Step time, bytes per step per axis and link class, bucket wait of one run's dump."""
    from mpipar.analysis import load
    from mpipar.analysis.breakdown import breakdown
    from mpipar.analysis.links import link_bytes

    run = load(run_dir / "trace.h5")
    summary = breakdown(run)["summary"]
    steps = run.steps()
    per_step = max(len(steps), 1)
    row = {"step ms": round(summary["step_time"] * 1e3, 2)}
    moved = link_bytes(run, steps)
    for axis in AXES:
        for where in ("within", "across"):
            row[f"{axis} {where} KB"] = round(moved.get(axis, {}).get(where, 0) / per_step / 1e3, 1)
    waits = [float(np.sum(ev["end"][m] - ev["start"][m]))
             for ev in run.events
             for m in [np.isin(ev["step"], steps) & (ev["kind"] == "dp.wait")]]
    row["bucket wait ms"] = round(sum(waits) / len(waits) / per_step * 1e3, 3) if waits else 0.0
    return row


def train(spec, hosts, ppn, run_dir: Path, data: Path, args, extra: list[str]) -> dict:
    if not (args.reuse and common.complete_dump(run_dir)):
        cmd = nodes.mpiexec_argv(spec, ppn, [
            sys.executable, "-m", "mpipar.cli", "train", "--config",
            str(common.CONFIGS / "tiny.toml"), "--data", str(data), "--out", str(run_dir),
            "--steps", str(args.steps), "--set", "train.eval_interval=0", "--quiet",
            *(QUICK_MODEL if args.quick else []), *extra], hosts)
        common.run_command(cmd, args.timeout, run_dir.name)
    return analyse(run_dir)


def _plan(row: dict, run_dir: Path, args, rate: str | None, ranks_per_node: int | None) -> dict:
    """``row`` with its planned step (ms) where a spec of this machine was given."""
    if args.base_spec is None:
        return row
    c = args.base_spec if rate is None else multinode_plan.emulated(
        args.base_spec, rate, args.p2p_latency.get(rate), nodes=2)
    return {**row, "planned ms": multinode_plan.planned_ms(run_dir, c, ranks_per_node)}


def run_all(args, out: Path) -> list[dict]:
    """One row per run; the cluster is torn down after each rate, also on an error."""
    out.mkdir(parents=True, exist_ok=True)
    data = token_file(out)
    # the ranks start in the cluster launcher's working directory: name this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(common.ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    rows = []
    both = ["node0", "node1"]
    for k, rate in enumerate(args.train_rates):
        spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link=rate, shm_size="256m"))
        try:
            for where, order in (("inside", "tp-dp-pp"), ("across", "dp-tp-pp")):
                label = f"tp-{where}@{rate}"
                rows.append(_plan({"run": label, "ranks": "2 nodes x 2", "rate": rate, **train(
                    spec, both, 2, out / label, data, args,
                    ["--dp", "2", "--tp", "2", "--set", f"parallel.order={order}"])},
                    out / label, args, rate, 2))
            if k == 0:
                rows.append(_plan({"run": "dp-1node", "ranks": "1 node x 2", "rate": "-", **train(
                    spec, ["node0"], 2, out / "dp-1node", data, args, ["--dp", "2"])},
                    out / "dp-1node", args, None, None))
            label = f"dp-2nodes@{rate}"
            rows.append(_plan({"run": label, "ranks": "2 nodes x 1", "rate": rate, **train(
                spec, both, 1, out / label, data, args, ["--dp", "2"])},
                out / label, args, rate, 1))
        finally:
            nodes.down(NAME)
    return rows


def columns(planned: bool = False) -> list[str]:
    return (["run", "ranks", "rate", "step ms"] + (["planned ms"] if planned else [])
            + ["bucket wait ms"]
            + [f"{a} {w} KB" for a in AXES for w in ("within", "across")])


def run(args, out: Path) -> list[dict]:
    """Run the training rows into ``out`` and write their table (results.{csv,json,md})."""
    args.train_rates = [r for r in (args.train_rates or
                                    (QUICK_RATES if args.quick else RATES)).split(",") if r]
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    args.base_spec = multinode_plan.base_spec(getattr(args, "spec", None))
    args.p2p_latency = getattr(args, "p2p_latency", None) or {}
    nodes.down(NAME)  # what an earlier, killed run may have left
    rows = run_all(args, out)
    meta = {**common.machine_note(), "rates": args.train_rates, "steps": args.steps,
            "quick": bool(args.quick)}
    if args.base_spec is not None:
        meta["planned"] = (f"spec {args.base_spec.name}; [inter_node]: the link rate, latency "
                           "the p2p rows' smallest message across it (multinode_plan.py)")
    common.write_results(out, "training across nodes (per step; KB: bytes / 1000)", rows,
                         columns(args.base_spec is not None), meta)
    diff = multinode_plan.differences(rows)
    if diff:
        (out / "placement").mkdir(exist_ok=True)
        common.write_results(out / "placement", "tp across nodes minus tp inside a node "
                             "(ms per step)", diff, list(diff[0]), meta)
    if args.base_spec is None:
        print("planned: no spec of this machine (--spec FILE or $MPIPAR_SPEC; "
              "mpipar plan measure --out FILE makes one)")
    return rows
