"""Experiment 4: strong and weak scaling along dp, pp and tp (1, 2, 4, 8 ranks).

Strong scaling keeps the problem (experiments/configs/exp_scale.toml: 8 blocks of width 128,
global batch 16 x 32 tokens) and splits it over more ranks along one axis. Weak scaling grows the
problem with the ranks so each rank's share stays put: dp grows the global batch (16 sequences
per replica), pp the depth (2 blocks per stage), tp the width (n_embd ~ sqrt(tp): 64, 96, 128,
176, so parameters per rank stay about constant). Pipeline runs use 1F1B with 8 micro-batches
(the pp = 1 point too: gradient accumulation), dp and tp runs one micro-batch.

IMPORTANT on this machine: 8 ranks share the cores it has (2 here), so throughput cannot rise
past 2 ranks; what still scales meaningfully is each rank's compute time (its share of the work)
and the share of the step spent communicating. Columns: ``compute_ms`` (self time of F, B, W, R,
LOSS, OPT per rank and step), ``comm_share`` (self time in pp/tp/dp/world communication / step),
``idle_share``, ``efficiency`` (strong: tokens/s per rank against 1 rank; weak: step time of 1
rank / step time of n), ``core_eff`` (the best efficiency the cores allow: min(n, cores) / n).

Run: ``python experiments/scaling.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "scaling"
COLUMNS = ["mode", "axis", "n", "tokens_per_s", "step_ms", "compute_ms", "comm_share",
           "idle_share", "bubble", "efficiency", "core_eff"]
WEAK_WIDTH = {1: 64, 2: 96, 4: 128, 8: 176}
COMPUTE = ("F", "B", "W", "R", "LOSS", "OPT")
COMM = ("pp", "tp", "dp", "world")


def settings(mode: str, axis: str, n: int, quick: bool) -> dict:
    n_layer = 8
    s = {f"parallel.{axis}": n}
    if axis == "pp":
        s["parallel.microbatches"] = 8 if not quick else 2
    if mode == "weak":
        if axis == "dp":
            s["train.batch_size"] = (16 if not quick else 4) * n
        elif axis == "pp":
            n_layer = 2 * n
            s["model.n_layer"] = n_layer
        else:
            s["model.n_embd"] = WEAK_WIDTH[n] if not quick else 16 * n
    if quick:
        s.setdefault("model.n_layer", 2 * n if axis == "pp" else 2)
        n_layer = s["model.n_layer"]
        s.setdefault("model.n_embd", 32)
        s.update({"model.n_head": 4 if axis != "tp" else max(2, n), "train.seq_len": 16})
        s.setdefault("train.batch_size", 8)
    if axis == "pp":
        s["parallel.partition"] = "explicit"
        s["parallel.boundaries"] = common.balanced_boundaries(n_layer, n)
    return s


def measure(path) -> dict:
    from mpipar.analysis import breakdown

    res = breakdown(path)
    s, r = res["summary"], res["ranks"]
    st = r["step_time"]
    return {
        "tokens_per_s": s["tokens_per_s"], "step_ms": 1e3 * s["step_time"],
        "compute_ms": 1e3 * float(sum(r[f"self_{k}"] for k in COMPUTE).mean()),
        "comm_share": float((sum(r[f"self_{a}"] for a in COMM) / st).mean()),
        "idle_share": float((r["idle"] / st).mean()), "bubble": s["bubble"],
        "step_time": s["step_time"],
    }


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    config = common.CONFIGS / "exp_scale.toml"
    steps = args.steps or (2 if args.quick else 5)  # noisy shared machine: 4 measured
    sizes = (1, 2) if args.quick else (1, 2, 4, 8)
    modes = ("strong",) if args.quick else ("strong", "weak")
    axes = ("dp", "tp") if args.quick else ("dp", "pp", "tp")
    cores = len(os.sched_getaffinity(0))
    rows, done = [], {}
    for mode in modes:
        for axis in axes:
            for n in sizes:
                sets = settings(mode, axis, n, args.quick)
                sets["train.steps"] = steps
                key = tuple(sorted((k, common._value(v)) for k, v in sets.items()))
                if key not in done:  # e.g. strong dp=1 and strong tp=1 are the same run
                    path = common.train(out / f"{mode}_{axis}{n}", n, config, sets, args)
                    done[key] = measure(path)
                rows.append({"mode": mode, "axis": axis, "n": n, **done[key],
                             "core_eff": min(n, cores) / n})
    for row in rows:
        ref = next(r for r in rows if r["mode"] == row["mode"] and r["axis"] == row["axis"]
                   and r["n"] == 1)
        if row["mode"] == "strong":
            row["efficiency"] = row["tokens_per_s"] / row["n"] / ref["tokens_per_s"]
        else:
            row["efficiency"] = ref["step_time"] / row["step_time"]
    common.write_results(out, f"scaling ({cores} cores available; up to {max(sizes)} ranks)",
                         rows, COLUMNS, meta={"config": str(config), "steps": steps,
                                              "quick": args.quick, **common.machine_note()})
    plot(rows, out / f"{NAME}.png", cores)
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def plot(rows, path, cores):
    plt = common.pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(modes), 3, figsize=(14, 4 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for axis in dict.fromkeys(r["axis"] for r in rows):
            sel = sorted((r["n"], r) for r in rows if r["mode"] == mode and r["axis"] == axis)
            xs = [p[0] for p in sel]
            axes[i][0].plot(xs, [p[1]["tokens_per_s"] for p in sel], "o-", label=axis)
            axes[i][1].plot(xs, [p[1]["compute_ms"] for p in sel], "o-", label=axis)
            axes[i][2].plot(xs, [100 * p[1]["comm_share"] for p in sel], "o-", label=axis)
        axes[i][0].set_ylabel(f"{mode}: tokens/s")
        axes[i][1].set_ylabel(f"{mode}: compute ms per rank per step")
        axes[i][2].set_ylabel(f"{mode}: % of step communicating")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ticks = sorted({r["n"] for r in rows})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.set_xlabel("ranks along the axis")
            ax.axvline(cores, color="grey", linewidth=0.8, linestyle=":")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    axes[0][0].set_title(f"throughput (dotted line: {cores} cores)")
    axes[0][1].set_title("per-rank compute (self time)")
    axes[0][2].set_title("communication share (self time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
