"""Timing dumps at cluster scale: analysis time and memory against the events, dump size
against compression, and what a dump flush costs a running job.

1. ``analyze``: realistic synthetic dumps (``mpipar.analysis.synthetic_run``: 1F1B, m = 4,
   pp = 4, dp = ranks / 4, 1,000 steps) at events x1, x4, x16 (64, 256, 1,024 ranks), each
   analysed by ``mpipar analyze`` in its own process: wall time and peak RSS, with
   ``--sample N`` (default 20) and, up to ``--full-max-ranks`` ranks (default none), without.
2. ``compression``: the x1 dump's events written with none, lzf, gzip (with byte shuffle):
   bytes on disk (sizes, not timings).
3. ``flush``: per-step flush cost at 8 and 32 ranks for each ``--code DIR`` (a checkout of
   mpipar: the one to measure before, e.g. commit 4dc8308 whose flush gathered every rank's
   events to rank 0, and the one after): the tiny GPT trained ``--flush-steps`` steps flushing
   every step and flushing only at the end. The cost is the time between two steps (a STEP
   marker's end to the next one's start, every rank, read from the dump: start-up and the
   final flush left out) flushing every step, less the same flushing at the end. Where the
   dump records its own flushes (``dump.flush`` events), their mean per rank is given beside.

Run alone on the machine (load < 1.5), e.g. the flush table alone, before and after (about 3
min): ``git archive 4dc8308 | tar -x -C /tmp/before`` then
``python experiments/analysis_scale.py --skip-analyze --code /tmp/before --code .``; the
analysis table, every step of every size analysed (a x1/x4/x16 table printed and written to
scale_table.md): ``python experiments/analysis_scale.py --ranks 64 256 1024 --dump-steps 1000
--full-max-ranks 1024 --skip-compression``. ``--quick``
checks it in about a minute. Writes results.csv/json/md and results.h5 under ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import ROOT, env, out_dir, parser, write_results  # noqa: E402

# the analysing process reports its own peak RSS (KiB on Linux) after the analysis
ANALYZE = ("import resource, sys, time; from mpipar.cli import main; t = time.perf_counter(); "
           "u = resource.getrusage(resource.RUSAGE_SELF).ru_utime; "
           "rc = main(['analyze'] + sys.argv[1:] + ['--format', 'json']); "
           "w = time.perf_counter() - t; ru = resource.getrusage(resource.RUSAGE_SELF); "
           "print('@@', w, ru.ru_maxrss, rc, ru.ru_utime - u, file=sys.stderr)")


def pythonpath_env(code: Path) -> dict:
    e = env()
    e["PYTHONPATH"] = str(code)
    return e


def analyse(path: Path, extra: list[str], timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-c", ANALYZE, str(path), *extra], env=pythonpath_env(
        ROOT), capture_output=True, text=True, timeout=timeout)
    line = [s for s in out.stderr.splitlines() if s.startswith("@@")]
    if not line:
        raise RuntimeError(f"analyze {path} {extra} failed:\n{out.stderr[-2000:]}")
    _, wall, rss, rc, user = line[-1].split()
    res = json.loads(out.stdout)["runs"][0]["summary"] if rc == "0" else {}
    return {"wall_s": float(wall), "user_s": float(user), "peak_rss_mib": int(rss) / 1024,
            "step_time_pred": res.get("step_time_pred"), "bubble_pred": res.get("bubble_pred")}


def analysis_rows(args, out: Path) -> list[dict]:
    from mpipar.analysis.synthetic_run import write_run

    rows = []
    for ranks in args.ranks:
        path = out / f"synthetic_{ranks}x{args.dump_steps}.h5"
        t = time.perf_counter()
        info = write_run(path, dp=ranks // 4, pp=4, tp=1, steps=args.dump_steps)
        made = time.perf_counter() - t
        modes = [["--sample", str(args.sample)]] + ([[]] if ranks <= args.full_max_ranks else [])
        for extra in modes:
            got = analyse(path, extra, args.timeout)
            rows.append({"ranks": ranks, "steps": args.dump_steps, "events": info["events"],
                         "file_mib": path.stat().st_size / 2**20, "write_s": made,
                         "mode": " ".join(extra) or "all steps", **got})
            print(rows[-1], flush=True)
        if not args.keep:
            path.unlink()
    return rows


def scale_table(rows: list[dict]) -> str:
    """The analysis rows as a table, per mode: events x1, x4, x16 against the smallest, wall
    and CPU user seconds (user: what load on a shared machine inflates least), peak RSS, and
    microseconds and bytes of peak RSS per event (flat: linear in the events)."""
    lines = ["| ranks | events | x events | mode | wall s | user s | peak RSS MiB | user us/event "
             "| RSS B/event |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        got = [r for r in rows if r["mode"] == mode]
        base = got[0]["events"]
        for r in got:
            lines.append(f"| {r['ranks']} | {r['events']:,} | {r['events'] / base:.0f} | {mode} | "
                         f"{r['wall_s']:.1f} | {r['user_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{1e6 * r['user_s'] / r['events']:.2f} | "
                         f"{r['peak_rss_mib'] * 2**20 / r['events']:.0f} |")
    return "\n".join(lines)


def compression_rows(args, out: Path) -> list[dict]:
    import h5py

    from mpipar.analysis.synthetic_run import write_run

    rows = []
    for name, kw in (("none", {}), ("lzf", {"compression": "lzf", "shuffle": True}),
                     ("gzip-1", {"compression": "gzip", "compression_opts": 1, "shuffle": True}),
                     ("gzip-4", {"compression": "gzip", "compression_opts": 4, "shuffle": True})):
        path = out / f"compress_{name}.h5"
        info = write_run(path, dp=args.ranks[0] // 4, pp=4, steps=args.dump_steps // 4,
                         compression=kw or None) if not kw else None
        if kw:  # the same events again, filtered
            with h5py.File(out / "compress_none.h5") as src, h5py.File(path, "w") as dst:
                for r in src["ranks"]:
                    dst.create_dataset(f"ranks/{r}/events", data=src[f"ranks/{r}/events"][()],
                                       chunks=(1024,), maxshape=(None,), **kw)
        size = path.stat().st_size
        rows.append({"filter": name, "bytes": size, "events": info["events"] if info else None})
    base = rows[0]["bytes"]
    for r in rows:
        r["ratio"] = base / r["bytes"]
        r["bytes_per_event"] = r["bytes"] / (rows[0]["events"] or 1)
    for name in ("none", "lzf", "gzip-1", "gzip-4"):
        (out / f"compress_{name}.h5").unlink(missing_ok=True)
    return rows


def _train(code: Path, ranks: int, flush_every: int, steps: int, run_dir: Path, timeout):
    grid = {8: ("2", "2", "2"), 32: ("8", "2", "2")}.get(ranks, (str(ranks // 2), "2", "1"))
    batch = 16 * max(1, int(grid[0]) // 2)  # 8 samples a replica: m = 4 micro-batches of 2
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpipar.cli", "train", "--config",
           str(ROOT / "experiments/configs/tiny.toml"), "--dp", grid[0], "--pp", grid[1],
           "--tp", grid[2], "--out", str(run_dir), "--set", f"train.steps={steps}",
           "--set", f"run.flush_interval={flush_every}", "--set", "train.eval_interval=0",
           "--set", "run.log_interval=1000", "--set", f"train.batch_size={batch}"]
    t = time.perf_counter()
    subprocess.run(cmd, env=pythonpath_env(code), check=True, capture_output=True,
                   timeout=timeout, cwd=str(code))
    return time.perf_counter() - t


def _flush_events(path: Path) -> float | None:
    """Mean seconds of one rank's ``dump.flush`` events (None: the dump records none)."""
    from mpipar.analysis import load

    run = load(path)
    d = [float((e["end"] - e["start"])[e["kind"] == "dump.flush"].mean())
         for e in run.events if (e["kind"] == "dump.flush").any()]
    return float(np.mean(d)) if d else None


def between_steps(path: Path) -> float:
    """Mean seconds from a STEP marker's end to the next one's start, over every rank and the
    steps after the warm-up step 0 (what a flush between two steps adds to)."""
    from mpipar.analysis import load

    gaps = []
    for ev in load(path).events:
        st = np.sort(ev[(ev["kind"] == "STEP") & (ev["step"] >= 1)], order="step")
        gaps.extend((st["start"][1:] - st["end"][:-1]).tolist())
    return float(np.mean(gaps)) if gaps else float("nan")


def flush_rows(args, out: Path) -> list[dict]:
    rows = []
    for code in args.code:
        code = Path(code).resolve()
        for ranks in args.flush_ranks:
            walls, gaps = {}, {}
            for every in (1, 0):
                d = out / f"flush_{code.name}_{ranks}_{every}"
                walls[every] = _train(code, ranks, every, args.flush_steps, d, args.timeout)
                gaps[every] = between_steps(d / "trace.h5")
            per_step = gaps[1] - gaps[0]
            rows.append({"code": str(code), "ranks": ranks, "steps": args.flush_steps,
                         "wall_flush_every_step_s": walls[1], "wall_flush_at_end_s": walls[0],
                         "between_steps_flushing_ms": 1e3 * gaps[1],
                         "between_steps_not_flushing_ms": 1e3 * gaps[0],
                         "flush_cost_per_step_ms": 1e3 * per_step,
                         "dump_flush_event_ms": (lambda v: None if v is None else 1e3 * v)(
                             _flush_events(out / f"flush_{code.name}_{ranks}_1" / "trace.h5"))})
            print(rows[-1], flush=True)
    return rows


def write_h5(out: Path, tables: dict) -> None:
    import h5py

    with h5py.File(out / "results.h5", "w") as f:
        for name, rows in tables.items():
            g = f.create_group(name)
            for col in (rows[0] if rows else {}):
                vals = [r.get(col) for r in rows]
                if all(isinstance(v, (int, float)) for v in vals):
                    g.create_dataset(col, data=np.array(vals, dtype=float))
                else:
                    g.create_dataset(col, data=np.array([str(v) for v in vals], dtype="S"))


def main() -> int:
    p = parser("analysis_scale", __doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--dump-steps", type=int, default=1000)
    p.add_argument("--sample", type=int, default=20)
    p.add_argument("--full-max-ranks", type=int, default=0,
                   help="analyse all steps too (no --sample) up to this many ranks (read a "
                   "rank at a time: one rank's events plus per-step summaries of all)")
    p.add_argument("--code", action="append", default=[],
                   help="an mpipar checkout whose flush to measure (repeat: before, after)")
    p.add_argument("--flush-ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--flush-steps", type=int, default=8)
    p.add_argument("--skip-analyze", action="store_true",
                   help="only the flush table (with --code)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic dumps")
    p.add_argument("--skip-compression", action="store_true",
                   help="only the analysis table (no compression rows)")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.dump_steps, args.sample = [8, 16], 40, 5
        args.flush_ranks, args.flush_steps = [4], 6
        args.full_max_ranks = 16
    out = out_dir(args, "analysis_scale")
    os.environ.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    tables = {}
    if not args.skip_analyze:
        tables["analyze"] = analysis_rows(args, out)
        print(scale_table(tables["analyze"]), flush=True)
        (out / "scale_table.md").write_text(scale_table(tables["analyze"]) + "\n")
        if not args.skip_compression:
            tables["compression"] = compression_rows(args, out)
    if args.code:
        tables["flush"] = flush_rows(args, out)
    for name, rows in tables.items():
        if rows:
            write_results(out / name if (out / name).mkdir(exist_ok=True) is None else out,
                          f"analysis_scale {name}", rows, list(rows[0]))
    write_h5(out, tables)
    print(f"wrote {out / 'results.h5'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
