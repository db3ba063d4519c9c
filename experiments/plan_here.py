"""Experiment: `mpipar plan` against the runs of this machine (planned from a spec, then run).

Input: a cluster spec of this machine, measured once (``mpipar plan measure --out here.toml``)
and never refitted to these rows. For every configuration it trains a short ``mpipar train``
(24 steps; the steps after the first measured: with 8 a row's step moved by up to 40 % between
two quiet runs), then puts side by side:

- measured: the mean step time (``mpipar.analysis.breakdown``) and the peak memory of the
  busiest rank (``mem.static + mem.peak - mem.base``, ``analysis.predict.measured_memory``);
- planned: ``mpipar.plan.here.planned`` from the run's configuration and the spec alone (the
  calibrated path's simulator and memory model, costs from FLOPs, bytes and the spec).

Table 1, one node (>= 12 rows): a tiny GPT (experiments/configs/tiny.toml), a larger one
(exp_bubble.toml: 8 blocks of 128) and the MLP (mlp.toml); pp 1/2, tp 1/2, dp 1/2; gpipe, 1f1b,
interleaved, zb-h1; recompute none/full/selective. Targets: step and memory within 10 %.
Table 2, ranking: >= 8 layouts of the larger GPT on 4 ranks; the planner's top pick (least
planned step) against the measured best (within 5 %), and the Spearman rank correlation of
planned and measured step times (>= 0.8).

``--emulated PPN``: run every row through ``mpipar cluster mpiexec --ppn PPN`` on the emulated
cluster (which must be up, with nodes x PPN = each row's ranks); the spec should then be one
measured there (``mpipar plan measure --inter-node``).
Run: ``python experiments/plan_here.py --spec here.toml [--quick] [--out DIR]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "plan_here"
COLUMNS = ["table", "model", "grid", "schedule", "v", "m", "recompute", "step_ms",
           "planned_ms", "step_err_pct", "no_floor_ms", "no_floor_err_pct", "mem_mib",
           "planned_mib", "mem_err_pct", "ok"]
STEP_PCT, MEM_PCT, PICK_PCT, SPEARMAN = 10.0, 10.0, 5.0, 0.8
MODELS = {"tiny": "tiny.toml", "gpt8": "exp_bubble.toml", "mlp": "mlp.toml"}


def one_node(quick: bool):
    """(model, dp, pp, tp, schedule, v, m, recompute) of table 1."""
    if quick:
        yield from [("tiny", 1, 1, 1, "1f1b", 1, 4, "none"),
                    ("tiny", 1, 2, 1, "1f1b", 1, 4, "none"),
                    ("mlp", 1, 2, 1, "gpipe", 1, 2, "none")]
        return
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        yield "tiny", 1, 2, 1, sched, v, 4, "none"
    yield from [("tiny", 1, 1, 1, "1f1b", 1, 4, "none"), ("tiny", 1, 1, 2, "1f1b", 1, 4, "none"),
                ("tiny", 2, 1, 1, "1f1b", 1, 4, "none")]
    for rec in ("none", "full", "selective"):
        yield "gpt8", 1, 2, 1, "1f1b", 1, 4, rec
    yield from [("gpt8", 1, 2, 1, "interleaved", 2, 4, "none"),
                ("gpt8", 2, 2, 1, "1f1b", 1, 4, "none"), ("gpt8", 1, 2, 2, "1f1b", 1, 4, "none"),
                ("mlp", 1, 1, 1, "1f1b", 1, 2, "none"), ("mlp", 1, 2, 1, "1f1b", 1, 4, "none"),
                ("mlp", 2, 1, 1, "1f1b", 1, 2, "none")]


def ranking(quick: bool):
    """Layouts of one model on one rank count (table 2)."""
    if quick:
        return [("tiny", 2, 1, 1, "1f1b", 1, 4, "none"), ("tiny", 1, 2, 1, "1f1b", 1, 4, "none"),
                ("tiny", 1, 1, 2, "1f1b", 1, 4, "none")]
    return [("gpt8", dp, pp, tp, s, v, 4, "none") for dp, pp, tp, s, v in (
        (4, 1, 1, "1f1b", 1), (2, 2, 1, "1f1b", 1), (2, 2, 1, "gpipe", 1),
        (1, 4, 1, "1f1b", 1), (1, 4, 1, "interleaved", 2), (1, 4, 1, "zb-h1", 1),
        (1, 2, 2, "1f1b", 1), (2, 1, 2, "1f1b", 1), (1, 1, 4, "1f1b", 1))]


def launcher(args, ranks: int) -> list[str]:
    if args.emulated:
        return [sys.executable, "-m", "mpipar.cli", "cluster", "mpiexec", "--ppn",
                str(args.emulated), "--"]
    return ["mpiexec", "-n", str(ranks)]


_DONE: set = set()  # runs trained by this invocation (a layout in both tables runs once)


def train(args, out: Path, row) -> Path:
    model, dp, pp, tp, sched, v, m, rec = row
    name = f"{model}-dp{dp}pp{pp}tp{tp}-{sched}-v{v}-m{m}-{rec}"
    run_dir = out / name
    if (args.reuse or name in _DONE) and common.complete_dump(run_dir):
        return run_dir / "trace.h5"
    _DONE.add(name)
    sets = {"parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp, "parallel.schedule": sched,
            "parallel.virtual_stages": v, "parallel.microbatches": m,
            "parallel.recompute": rec, "parallel.partition": "uniform",
            "train.steps": args.steps or (3 if args.quick else 24), "train.eval_interval": 0,
            "run.progress": "false", "run.flush_interval": 0}
    cmd = launcher(args, dp * pp * tp) + [
        sys.executable, "-m", "mpipar.cli", "train", "--config",
        str(common.CONFIGS / MODELS[model]), "--out", str(run_dir)]
    for k, val in sets.items():
        cmd += ["--set", f"{k}={val}"]
    common.run_command(cmd, args.timeout, name)
    return run_dir / "trace.h5"


def _err(pred, meas):
    return 100 * (pred - meas) / meas if pred is not None and meas else None


def measure_row(args, out: Path, row, cluster, table: str) -> dict:
    from mpipar.analysis import breakdown, load
    from mpipar.analysis.predict import measured_memory
    from mpipar.plan.here import planned

    path = train(args, out, row)
    run = load(str(path))
    s = breakdown(run)["summary"]
    pl = planned(run.config, run.grid, cluster, args.emulated)
    bare = planned(run.config, run.grid, cluster, args.emulated, with_floor=False)
    mem = measured_memory(run)
    got = max(mem) if mem else None
    want = max(pl["memory"]) if pl.get("memory") else None
    model, dp, pp, tp, sched, v, m, rec = row
    r = {"table": table, "model": model, "grid": f"{dp}x{pp}x{tp}", "schedule": sched, "v": v,
         "m": m, "recompute": rec, "step_ms": 1e3 * s["step_time"],
         "planned_ms": 1e3 * pl["step"], "mem_mib": got / 2**20 if got else None,
         "planned_mib": want / 2**20 if want else None}
    r["step_err_pct"] = _err(r["planned_ms"], r["step_ms"])
    r["no_floor_ms"] = 1e3 * bare["step"]  # without the executor's in-event floor (a term)
    r["no_floor_err_pct"] = _err(r["no_floor_ms"], r["step_ms"])
    r["mem_err_pct"] = _err(r["planned_mib"], r["mem_mib"])
    r["ok"] = (abs(r["step_err_pct"]) <= STEP_PCT and r["mem_err_pct"] is not None
               and abs(r["mem_err_pct"]) <= MEM_PCT)
    return r


def spearman(a, b) -> float:
    """Spearman's rank correlation (ranks by argsort; no ties expected in timings)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else float("nan")


def rank_summary(rows: list[dict]) -> dict:
    meas = [r["step_ms"] for r in rows]
    plan = [r["planned_ms"] for r in rows]
    pick, best = int(np.argmin(plan)), int(np.argmin(meas))
    gap = 100 * (meas[pick] / meas[best] - 1)
    rho = spearman(plan, meas)
    return {"top_pick": f"{rows[pick]['grid']} {rows[pick]['schedule']}",
            "measured_best": f"{rows[best]['grid']} {rows[best]['schedule']}",
            "pick_gap_pct": gap, "spearman": rho,
            "ok": gap <= PICK_PCT and rho >= SPEARMAN}


def main() -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--spec", required=True,
                   help="cluster spec of this machine (mpipar plan measure --out FILE)")
    p.add_argument("--emulated", type=int, default=None, metavar="PPN",
                   help="run the rows on the emulated cluster (mpipar cluster mpiexec --ppn PPN)")
    args = p.parse_args()
    from mpipar.plan import PlanError, load_cluster

    try:
        cluster = load_cluster(args.spec)
    except PlanError as exc:
        print(f"plan_here: {exc}", file=sys.stderr)
        return 2
    out = common.out_dir(args, NAME)
    t0 = time.perf_counter()
    rows = [measure_row(args, out, row, cluster, "one-node") for row in one_node(args.quick)]
    ranked = [measure_row(args, out, row, cluster, "ranking") for row in ranking(args.quick)]
    summary = rank_summary(ranked)
    meta = {"spec": args.spec, "cluster": cluster.name, "seconds": time.perf_counter() - t0,
            "ranking": summary, "machine": common.machine_note(),
            "terms": "planned = plan.here: unit floor + GEMM + k x element-wise per phase "
                     "([units]), the executor's in-event floor per compute action "
                     "(no_floor_ms: without it), executor costs ([executor]), core sharing "
                     "beyond cores_per_node, p2p/collective links; one spec for every row"}
    common.write_results(out, NAME, rows + ranked, COLUMNS, meta)
    ok = sum(1 for r in rows if r["ok"])
    print(f"one node: {ok} of {len(rows)} rows within {STEP_PCT:.0f} % (step) and "
          f"{MEM_PCT:.0f} % (memory)")
    print(f"ranking over {len(ranked)} layouts: planner's pick {summary['top_pick']}, measured "
          f"best {summary['measured_best']} (pick {summary['pick_gap_pct']:+.1f} % slower), "
          f"Spearman {summary['spearman']:.2f}; "
          f"{'meets' if summary['ok'] else 'misses'} the bounds")
    print(f"took {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
