"""Experiment: `mpipar plan` against the runs of this machine (planned from a spec, then run).

Input: a cluster spec of this machine, measured once (``mpipar plan measure --out here.toml``)
and never refitted to these rows. Every configuration trains a short ``mpipar train``
(``--steps``, default 16; step 0 skipped as warm-up) ``--repeats`` times (default 3), the
repeats interleaved across the rows (every row once, then every row again: a burst of load
hits one repeat of many rows, not every repeat of one; a row's step moved by up to 40 %
between two quiet single runs), and puts side by side:

- measured: the median over the repeats of each run's median step (``median_step``: a step
  slowed by another process moves it less than the mean), with their spread ((max - min) /
  median), beside the median of the runs' mean step (``mean_ms``, ``mpipar.analysis.breakdown``),
  and of the peak memory of the busiest rank (``mem.static + mem.peak - mem.base``,
  ``analysis.predict.measured_memory``);
- planned: ``mpipar.plan.here.planned`` from the run's configuration and the spec alone (the
  calibrated path's simulator and memory model, costs from FLOPs, bytes and the spec). The
  terms added to the plain model are shown on every row: ``no_floor_ms`` (without the
  executor's in-event floor), ``no_share_ms`` (without core sharing: ranks beyond the node's
  cores), ``slice_wait_ms`` (the plan if each collective of ranks sharing cores also waited
  half a scheduler slice for its partners, ``plan.sharing.cosched_wait``: not in the plan),
  ``blocks_tp_ms`` (with the blocks' tp all-reduces only: without the embedding's, the
  head's and the loss's), ``no_slowdown_ms`` (ranks sharing cores at their bare share, without
  the spec's measured ``shared_slowdown``, ``plan.oversub``), ``own_nic_ms`` (every rank with
  a link of its own across nodes: without the node's one link shared by its ranks that cross
  at once, ``plan.placement``; the one-node rows have none),
  ``runtime_mib`` (memory the MPI runtime, BLAS and allocator touch during the steps,
  measured once on the probe run), ``trace_mib`` (the timing dump's events held in memory)
  and ``cold_opt_ms`` (every rank's OPT region at its cold costs: without the warm costs a
  rank gets when its optimizer state fits its core's cache, ``plan.opt_region.opt_warm``)
  and ``no_replica_ms`` (without the dp replicas' wait for the slowest, ``plan.replicas``)
  and ``shapes_ms`` (the units' GEMM, attention-core and element-wise parts weighed by the
  fit over the spec's other GPT shapes, ``plan.unit_fit``: beside the plan, not in it; the
  plan itself where the spec has no shapes).

The spec beside the runs (``plan.resample``): before each round of rows and after the last, a
short sample (~10 s alone: the fp32 GEMM curve, the element-wise rate, the unit chains, p2p and
all-reduce at the rows' own message sizes) is stored as ``<out>/specs/sample-NN.toml`` and put
over ``--spec``; ``planned_ms`` is planned from the median of the samples, ``near_ms`` from the
sample measured nearest each run (median over the repeats), ``band_lo_ms`` / ``band_hi_ms`` the
least and most planned step over the samples, ``in_band`` whether the measured step lies inside
(``--no-sample``: ``--spec`` alone, those columns empty). Nothing is fitted to the runs: every
sample is a measurement of the machine, taken before the run it is compared with is seen.

Table 1, one node (>= 12 rows): a tiny GPT (experiments/configs/tiny.toml), a larger one
(exp_bubble.toml: 8 blocks of 128) and the MLP (mlp.toml); pp 1/2, tp 1/2, dp 1/2; gpipe, 1f1b,
interleaved, zb-h1; recompute none/full/selective. Targets: step and memory within 10 %.
Table 2, ranking: >= 8 layouts of the larger GPT on 4 ranks; the planner's top pick (least
planned step) against the measured best (within 5 %), and the Spearman rank correlation of
planned and measured step times (>= 0.8).
Table 3, ``--emulated`` (root): the emulated 2-node cluster (``mpipar.cluster``), brought up
once per ``--rates`` rate and torn down after; per rate the link across the nodes is measured
(``plan.measure.links``: commbench, one rank per node; what ``mpipar plan measure --inter-node``
writes as ``[inter_node]``) and put into the machine's spec with the machine's cores split
over the nodes (``experiments/multinode_plan.emulated``), over the machine's samples taken
beside that rate's runs as above (``<out>/<rate>/specs``); >= 6 rows per rate, each axis that
crosses the link priced there (``plan.placement``). One node's table is skipped then.
Before the rows and after them, the machine's steadiness is sampled (``--steadiness SECONDS``,
``mpipar.plan.steadiness``) and printed: the spread of a fixed workload's speed over short
windows and the share of runs of a given length within 10 % of the median, the most often a
per-row 10 % bound can hold here whatever the plan (in ``results.json``'s meta).
Run: ``python experiments/plan_here.py --spec here.toml [--quick] [--out DIR]``;
``--replan DIR``: tables 1 and 2 planned again from the dumps of an earlier ``--out DIR``
and the spec samples stored there, over ``--spec`` (nothing run: a changed planner or spec
against the same measurements);
``python experiments/plan_here.py --spec here.toml --emulated [--rates 1gbit,200mbit]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's mpipar
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "plan_here"
COLUMNS = ["table", "model", "grid", "schedule", "v", "m", "recompute", "step_ms",
           "spread_pct", "mean_ms", "planned_ms", "step_err_pct", "near_ms", "near_err_pct",
           "band_lo_ms", "band_hi_ms", "in_band", "no_floor_ms", "slice_wait_ms", "blocks_tp_ms",
           "no_slowdown_ms", "no_share_ms", "cold_opt_ms", "no_replica_ms", "shapes_ms",
           "own_nic_ms", "mem_mib",
           "planned_mib", "mem_err_pct", "runtime_mib", "trace_mib", "ok"]
STEP_PCT, MEM_PCT, PICK_PCT, SPEARMAN = 10.0, 10.0, 5.0, 0.8
MODELS = {"tiny": "tiny.toml", "gpt8": "exp_bubble.toml", "mlp": "mlp.toml"}
STEPS, QUICK_STEPS = 16, 3
MAX_STEPS = 4000  # --run-seconds: the most steps a row runs


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


def row_name(row) -> str:
    model, dp, pp, tp, sched, v, m, rec = row
    return f"{model}-dp{dp}pp{pp}tp{tp}-{sched}-v{v}-m{m}-{rec}"


def train(args, out: Path, row, rep: int, launch: list[str]) -> Path:
    """Repeat ``rep`` of ``row`` under ``launch`` (mpiexec, or the emulated cluster's)."""
    model, dp, pp, tp, sched, v, m, rec = row
    name = f"{row_name(row)}-r{rep}"
    run_dir = out / name
    if args.reuse and common.complete_dump(run_dir):
        return run_dir / "trace.h5"
    sets = {"parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp, "parallel.schedule": sched,
            "parallel.virtual_stages": v, "parallel.microbatches": m,
            "parallel.recompute": rec, "parallel.partition": "uniform",
            "train.steps": steps_of(args, row),
            "train.eval_interval": 0, "run.progress": "false", "run.flush_interval": 0}
    cmd = launch + [sys.executable, "-m", "mpipar.cli", "train", "--config",
                    str(common.CONFIGS / MODELS[model]), "--out", str(run_dir)]
    for k, val in sets.items():
        cmd += ["--set", f"{k}={val}"]
    common.run_command(cmd, args.timeout, name)
    return run_dir / "trace.h5"


@functools.lru_cache(maxsize=None)
def _spec(path: str):
    from mpipar.plan import load_cluster

    return load_cluster(path)


def steps_of(args, row) -> int:
    """A row's steps: ``--steps`` (default STEPS); with ``--run-seconds T``, enough that the
    run's steps span T seconds by the plan of ``--spec`` (at least as many; the plan only
    sizes the run). A run of half a second on a machine whose speed switches between two
    levels lands on either (``mpipar.plan.steadiness``); a run of several seconds averages
    them, as a long training run does."""
    base = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if not getattr(args, "run_seconds", None):
        return base
    from mpipar.plan.here import planned

    step = planned(*row_config(row), _spec(args.spec))["step"]
    return int(min(max(base, math.ceil(args.run_seconds / step) + 1), MAX_STEPS))


def train_all(args, out: Path, rows, launch, between=None) -> None:
    """Every distinct row ``--repeats`` times, the repeats interleaved (module doc).
    ``launch(row)``: the launcher's argv for that row; ``between(k)``: called before each
    round and after the last (the spec samples, ``plan.resample``)."""
    distinct = list(dict.fromkeys(rows))
    for rep in range(args.repeats):
        if between:
            between(rep)
        for row in distinct:
            train(args, out, row, rep, launch(row))
    if between:
        between(args.repeats)


def row_config(row) -> tuple[dict, dict]:
    """(config, grid) of a row before it runs, as its dump will hold them."""
    import tomllib

    model, dp, pp, tp, sched, v, m, rec = row
    config = tomllib.loads((common.CONFIGS / MODELS[model]).read_text())
    config.setdefault("parallel", {}).update(microbatches=m, schedule=sched, recompute=rec,
                                             virtual_stages=v, partition="uniform")
    return config, {"dp": dp, "pp": pp, "tp": tp}


def sampler(args, folder: Path, rows):
    """``between`` for ``train_all``: a spec sample (``plan.resample.sample``) at the rows'
    message sizes, stored under ``folder``."""
    from mpipar.plan.resample import line, reduce_bytes, row_bytes, sample, save

    sizes = sorted({row_bytes(*row_config(row)) for row in rows})
    reduce = sorted({n for row in rows for n in reduce_bytes(*row_config(row))})
    for old in folder.glob("sample-*.toml"):  # an earlier run's into this --out: not these runs'
        old.unlink()

    def between(k: int) -> None:
        got = sample(sizes, reduce, args.quick, args.timeout)
        save(got, folder, k)
        print(f"spec sample {k}: {line(got)}", flush=True)
    return between


def _err(pred, meas):
    return 100 * (pred - meas) / meas if pred is not None and meas else None


def _mib(x):
    return x / 2**20 if x is not None else None


def median_step(run) -> float:
    """The median over the measured steps (step 0 skipped) of first STEP start to last STEP
    end over all ranks: a step slowed by another process moves it less than the mean."""
    lo, hi = {}, {}
    for ev in run.events:
        kinds = ev["kind"]
        for e in ev[kinds == (b"STEP" if kinds.dtype.kind == "S" else "STEP")]:
            s = int(e["step"])
            if s >= 1:
                lo[s] = min(lo.get(s, np.inf), float(e["start"]))
                hi[s] = max(hi.get(s, -np.inf), float(e["end"]))
    return float(np.median([hi[s] - lo[s] for s in lo])) if lo else float("nan")


def dumps_of(out: Path, row, repeats: int) -> list[Path]:
    """The row's dumps: ``<row>-r<rep>/trace.h5`` for each repeat, else (an older layout, one
    run per row) ``<row>/trace.h5``; a missing dump is one clear error."""
    got = [out / f"{row_name(row)}-r{rep}" / "trace.h5" for rep in range(repeats)]
    got = [p for p in got if p.is_file()] or [q for q in [out / row_name(row) / "trace.h5"]
                                              if q.is_file()]
    if not got:
        raise common.ExperimentError(f"no dump of {row_name(row)} under {out} (run the row, "
                                     "or give --replan the directory that holds it)")
    return got


def measure_row(args, out: Path, row, specs, table: str, ranks_per_node=None) -> dict:
    """One table row from the row's ``--repeats`` dumps (medians) and its plan; ``specs``: a
    ``plan.resample.SpecSet`` (or one ``Cluster``): planned from its median, from the sample
    nearest each run, and from every sample (the band)."""
    from mpipar.analysis import breakdown, load
    from mpipar.analysis.predict import measured_memory
    from mpipar.plan.here import planned
    from mpipar.plan.resample import SpecSet

    specs = specs if isinstance(specs, SpecSet) else SpecSet(specs)
    cluster = specs.median
    steps, means, mems, near, run = [], [], [], [], None
    for path in dumps_of(out, row, args.repeats):
        run = load(str(path))
        steps.append(median_step(run))
        means.append(breakdown(run)["summary"]["step_time"])
        mem = measured_memory(run)
        if mem:
            mems.append(max(mem))
        near.append(planned(run.config, run.grid, specs.nearest(path.stat().st_mtime),
                            ranks_per_node)["step"])
    step = float(np.median(steps))
    band = [planned(run.config, run.grid, c, ranks_per_node)["step"] for _, c in specs.samples]
    pl = planned(run.config, run.grid, cluster, ranks_per_node)
    bare = planned(run.config, run.grid, cluster, ranks_per_node, with_floor=False)
    alone = planned(run.config, run.grid, cluster, ranks_per_node, with_share=False)
    spin = planned(run.config, run.grid, cluster, ranks_per_node, with_cosched=True)
    blocks_tp = planned(run.config, run.grid, cluster, ranks_per_node, with_outside_tp=False)
    bare_share = planned(run.config, run.grid, cluster, ranks_per_node, with_slowdown=False)
    cold = planned(run.config, run.grid, cluster, ranks_per_node, with_warm=False)
    lone = planned(run.config, run.grid, cluster, ranks_per_node, with_replicas=False)
    shaped = planned(run.config, run.grid, cluster, ranks_per_node, with_shapes=True)
    own_nic = planned(run.config, run.grid, dataclasses.replace(cluster, nics_per_node=0),
                      ranks_per_node)
    busiest = int(np.argmax(pl["memory"])) if pl.get("memory") else None
    parts = pl["memory_parts"][busiest] if busiest is not None else {}
    model, dp, pp, tp, sched, v, m, rec = row
    r = {"table": table, "model": model, "grid": f"{dp}x{pp}x{tp}", "schedule": sched, "v": v,
         "m": m, "recompute": rec, "step_ms": 1e3 * step,
         "spread_pct": 100 * (max(steps) - min(steps)) / step,
         "mean_ms": 1e3 * float(np.median(means)),
         "planned_ms": 1e3 * pl["step"], "no_floor_ms": 1e3 * bare["step"],
         "slice_wait_ms": 1e3 * spin["step"], "blocks_tp_ms": 1e3 * blocks_tp["step"],
         "no_slowdown_ms": 1e3 * bare_share["step"],
         "no_share_ms": 1e3 * alone["step"],
         "cold_opt_ms": 1e3 * cold["step"], "no_replica_ms": 1e3 * lone["step"],
         "shapes_ms": 1e3 * shaped["step"], "own_nic_ms": 1e3 * own_nic["step"],
         "mem_mib": _mib(float(np.median(mems))) if mems else None,
         "planned_mib": _mib(parts.get("total")), "runtime_mib": _mib(parts.get("runtime")),
         "trace_mib": _mib(parts.get("trace"))}
    r["near_ms"] = 1e3 * float(np.median(near))
    r["band_lo_ms"] = 1e3 * min(band) if band else None
    r["band_hi_ms"] = 1e3 * max(band) if band else None
    r["in_band"] = (r["band_lo_ms"] <= r["step_ms"] <= r["band_hi_ms"]) if band else None
    r["step_err_pct"] = _err(r["planned_ms"], r["step_ms"])
    r["near_err_pct"] = _err(r["near_ms"], r["step_ms"])
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
            # the ranking the co-scheduling wait would give (shown beside, not in the plan)
            "spearman_slice_wait": spearman([r["slice_wait_ms"] for r in rows], meas),
            "ok": gap <= PICK_PCT and rho >= SPEARMAN}


def one_node_tables(args, out: Path, base: dict) -> tuple[list[dict], dict]:
    """Tables 1 and 2: run the rows (none with ``--replan DIR``: that directory's dumps),
    sampling the spec before each round and after the last (``plan.resample``; not with
    ``--no-sample``), and plan them from the base spec ``base`` with the samples over it
    (``--replan``: the samples stored in DIR)."""
    from mpipar.plan.resample import load_samples, note, spec_set, spread_line

    rows, ranked = list(one_node(args.quick)), ranking(args.quick)
    if args.replan:
        out = Path(args.replan)
    else:
        between = None if args.no_sample else sampler(args, out / "specs", rows + ranked)
        train_all(args, out, rows + ranked,
                  lambda row: ["mpiexec", "-n", str(row[1] * row[2] * row[3])], between)
    samples = [] if args.no_sample else load_samples(out / "specs")
    specs = spec_set(base, samples)
    if samples:
        print(spread_line(samples))
    got = [measure_row(args, out, row, specs, "one-node") for row in rows]
    got_ranked = [measure_row(args, out, row, specs, "ranking") for row in ranked]
    summary = rank_summary(got_ranked)
    ok = sum(1 for r in got if r["ok"])
    print(f"one node: {ok} of {len(got)} rows within {STEP_PCT:.0f} % (step) and "
          f"{MEM_PCT:.0f} % (memory), planned from the "
          + (f"median of {len(samples)} spec samples" if samples else "spec alone"))
    if samples:
        near = sum(1 for r in got if abs(r["near_err_pct"]) <= STEP_PCT)
        inside = sum(1 for r in got if r["in_band"])
        print(f"  step within {STEP_PCT:.0f} % planned from the sample nearest each run: "
              f"{near} of {len(got)}; measured inside the samples' band: {inside} of "
              f"{len(got)}")
    print(f"ranking over {len(got_ranked)} layouts: planner's pick {summary['top_pick']}, "
          f"measured best {summary['measured_best']} (pick {summary['pick_gap_pct']:+.1f} % "
          f"slower), Spearman {summary['spearman']:.2f} ({summary['spearman_slice_wait']:.2f} "
          "with slice_wait_ms); "
          f"{'meets' if summary['ok'] else 'misses'} the bounds")
    return got + got_ranked, {"ranking": summary, "one_node_ok": ok,
                              "samples": [note(s) for s in samples]}


TERMS = ("planned = plan.here: unit floor + GEMM + k x element-wise per phase ([units]; "
         "shapes_ms: a x GEMM + c x core GEMM + k x element-wise fitted over the spec's GPT "
         "shapes, not in the plan), the "
         "executor's in-event floor per compute action (no_floor_ms: without it), executor "
         "costs ([executor]), core sharing when a node runs more ranks than it has cores "
         "(no_share_ms: without it; no_slowdown_ms: the bare share, without the measured "
         "shared_slowdown; slice_wait_ms: with each collective also waiting half a "
         "scheduler slice, not in the plan), tp all-reduces of the blocks, the embedding, "
         "the head and the loss (blocks_tp_ms: the blocks' only), the OPT region warm where a "
         "rank's optimizer state fits its core's cache (cache_mb; cold_opt_ms: cold "
         "everywhere), the dp replicas' wait for the slowest (step_cv; no_replica_ms: without "
         "it), p2p/collective links, a node's link across nodes shared by its ranks that "
         "cross at once (nics_per_node; own_nic_ms: a link per rank); "
         "memory: the memory model + the runtime's (runtime_mb) + the trace's; one spec for "
         "every row")


def steadiness_note(seconds: float, when: str) -> dict:
    """The machine's steadiness (``mpipar.plan.steadiness``), printed: how often a run of a
    row's length lands within the step bound of the machine's median speed, whatever planned
    it (a bound no plan can beat on this machine)."""
    from mpipar.plan import steadiness

    summ = steadiness.measured(seconds)
    print(steadiness.report(summ, when), end="", flush=True)
    return summ


def main() -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--spec", required=True,
                   help="cluster spec of this machine (mpipar plan measure --out FILE)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per row, interleaved across the rows; the median is reported "
                        "(default 3)")
    p.add_argument("--emulated", action="store_true",
                   help="table 3 only: the rows on the emulated 2-node cluster (root)")
    p.add_argument("--rates", default=None,
                   help="--emulated: link rates, comma-separated (default 1gbit,200mbit)")
    p.add_argument("--replan", default=None, metavar="DIR",
                   help="tables 1 and 2 from the dumps already in DIR (a previous --out), "
                        "planned again with --spec and the spec samples stored in DIR/specs; "
                        "nothing is run")
    p.add_argument("--run-seconds", type=float, default=None, metavar="T",
                   help="run each row for about T seconds of steps (steps sized by the spec's "
                        "plan, at least --steps; default: --steps alone)")
    p.add_argument("--steadiness", type=float, default=None, metavar="SECONDS",
                   help="the machine's steadiness sampled this long before the rows and after "
                        "them (mpipar.plan.steadiness; default 10, --quick 1, 0: none)")
    p.add_argument("--no-sample", action="store_true",
                   help="plan from --spec alone: no spec samples beside the runs (nor those "
                        "stored in --replan DIR)")
    args = p.parse_args()
    if args.repeats < 1:
        print(f"plan_here: --repeats {args.repeats}: give 1 or more", file=sys.stderr)
        return 2
    if args.run_seconds is not None and not args.run_seconds > 0:
        print(f"plan_here: --run-seconds {args.run_seconds}: give a time > 0", file=sys.stderr)
        return 2
    if args.steadiness is not None and not args.steadiness >= 0:
        print(f"plan_here: --steadiness {args.steadiness}: give seconds >= 0 (0: none)",
              file=sys.stderr)
        return 2
    from mpipar.plan import PlanError, load_cluster
    from mpipar.plan.resample import read_base

    try:
        cluster = load_cluster(args.spec)
        base = read_base(args.spec)
    except PlanError as exc:
        print(f"plan_here: {exc}", file=sys.stderr)
        return 2
    out = common.out_dir(args, NAME)
    t0 = time.perf_counter()
    steady_s = 0.0 if args.replan else (
        args.steadiness if args.steadiness is not None else (1.0 if args.quick else 10.0))
    try:
        steady = {"before": steadiness_note(steady_s, "before the rows")} if steady_s > 0 else {}
    except PlanError as exc:
        print(f"plan_here: {exc}", file=sys.stderr)
        return 2
    if args.emulated:
        import plan_here_emulated

        from mpipar.cluster.spec import ClusterError

        # SIGTERM becomes an exception, so the `finally` that removes the cluster runs
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            rows, meta = plan_here_emulated.run(args, out / "emulated", base)
        except (ClusterError, PlanError, common.ExperimentError) as exc:
            print(f"plan_here: {exc}", file=sys.stderr)
            return 2
        out = out / "emulated"
    else:
        try:
            rows, meta = one_node_tables(args, out, base)
        except (common.ExperimentError, PlanError) as exc:
            print(f"plan_here: {exc}", file=sys.stderr)
            return 2
    if steady:
        try:
            steady["after"] = steadiness_note(steady_s, "after the rows")
        except PlanError as exc:  # the rows are measured: write them, say what is missing
            print(f"plan_here: warning: no steadiness sample after the rows: {exc}",
                  file=sys.stderr)
        meta["steadiness"] = steady
    meta.update({"spec": args.spec, "cluster": cluster.name, "repeats": args.repeats,
                 "seconds": time.perf_counter() - t0, "machine": common.machine_note(),
                 "terms": TERMS})
    common.write_results(out, NAME, rows, COLUMNS, meta)
    print(f"took {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
