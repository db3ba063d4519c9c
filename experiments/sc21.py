"""Megatron-LM SC'21 Table 1 predicted by `mpipar plan` against the published TFLOP/s per GPU.

    python experiments/sc21.py            # the table: published vs predicted, error per row
    python experiments/sc21.py --fit      # refit the A100 GEMM-efficiency constants (2 numbers)
    python experiments/sc21.py --rank     # where the paper's configuration ranks in the search

TFLOP/s use the paper's count, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step, over the
predicted step time of the paper's own configuration (examples/sc21/run_table_1.sh: tp, pp,
micro-batch size, interleaving, full recomputation). --fit fits the two hardware constants of
mpipar/plan/clusters/dgx-a100-80gb.toml's [gemm] once for all ten rows (least squares on
log TFLOP/s, grid search); every other number in that file comes from spec sheets or is assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpipar.plan import describe, load_cluster, plan  # noqa: E402
from mpipar.plan.sc21 import paper_fix, predict, shape, table1  # noqa: E402


def table(cluster) -> list[dict]:
    out = []
    for row in table1():
        got = predict(row, cluster)
        out.append({**row, "predicted": got["paper_tflops"], "step_s": got["step_time_s"],
                    "memory_gib": got["memory_gib"], "fits": got["fits"], "bubble": got["bubble"],
                    "error": got["paper_tflops"] / row["tflops"] - 1})
    return out


def fit(cluster) -> tuple[float, float, float]:
    """(max_efficiency, half_dim, rms log error) minimising the squared log error."""
    best = (math.inf, 0.0, 0.0)
    for i in range(60, 96):
        for half in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512):
            c = dataclasses.replace(cluster, gemm_max_efficiency=i / 100, gemm_half_dim=half)
            err = sum(math.log(1 + r["error"]) ** 2 for r in table(c))
            best = min(best, (err, i / 100, float(half)))
    err, e_max, half = best
    return e_max, half, math.sqrt(err / len(table1()))


def rank(cluster, row) -> tuple[int | None, dict, dict]:
    """Rank of the paper's configuration among full-recompute, no-SP, no-ZeRO-1 layouts (the
    2021 feature set), and the best row of the unrestricted search."""
    m = shape(row)
    fix = paper_fix(row)
    same = {k: fix[k] for k in ("recompute", "sp", "zero1")}
    rows = plan(m, cluster, row["gpus"], row["batch"], fixed=same, top=None)
    keys = ("dp", "pp", "tp", "schedule", "v", "microbatch_size")
    pos = next((i + 1 for i, r in enumerate(rows) if all(r[k] == fix[k] for k in keys)), None)
    free = plan(m, cluster, row["gpus"], row["batch"], top=1)[0]
    return pos, rows[0], free


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dgx-a100-80gb")
    ap.add_argument("--fit", action="store_true", help="refit the [gemm] constants and print them")
    ap.add_argument("--rank", action="store_true", help="also rank the paper's configurations")
    args = ap.parse_args(argv)
    c = load_cluster(args.cluster)
    if args.fit:
        e_max, half, rms = fit(c)
        print(f"[gemm] max_efficiency = {e_max}  half_dim = {half}  (rms log error {rms:.3f})")
        c = dataclasses.replace(c, gemm_max_efficiency=e_max, gemm_half_dim=half)
    print("| params (B) | GPUs | tp | pp | schedule | mbs | published TFLOP/s | predicted | error "
          "| memory GiB | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table(c):
        sched = r["schedule"] + (f" v={r['v']}" if r["schedule"] == "interleaved" else "")
        print(f"| {r['params_b']} | {r['gpus']} | {r['tp']} | {r['pp']} | {sched} | "
              f"{r['microbatch_size']} | {r['tflops']:.0f} | {r['predicted']:.1f} | "
              f"{100 * r['error']:+.1f}% | {r['memory_gib']:.1f} | {r['bubble']:.3f} |")
    if args.rank:
        print("\n| params (B) | paper's rank (full recompute, no SP/ZeRO-1) | best of those | "
              "best overall | its speed-up |")
        print("|---|---|---|---|---|")
        for row in table1():
            pos, best, free = rank(c, row)
            paper = predict(row, c)["step_time_s"]
            print(f"| {row['params_b']} | {pos} | {describe(best)} | {describe(free)} | "
                  f"{paper / free['step_time_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
