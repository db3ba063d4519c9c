"""Experiment 5: the same model on every 8-rank grid (dp x pp x tp = 8).

The GPT of experiments/configs/exp_scale.toml (8 blocks, 8 heads, width 128) with a global batch
of 32 sequences of 32 tokens and 4 micro-batches (1F1B; balanced explicit stage boundaries),
trained a few steps on each of the ten grids (8,1,1), (4,2,1), ..., (1,1,8). Reports throughput,
the per-rank compute time and where the rest of the step went (self time in pp / tp / dp / world
communication, idle), the pipeline bubble, and the peak memory predicted beside the measured
(``mpipar analyze``'s memory model, its timing-dump and runtime parts included): the largest
measured rank, its stage's prediction, the worst error over every rank, every rank's error, and
the runtime part (MPI, BLAS, allocator: one number per machine, ``memory_model.RUNTIME_BYTES``).

On a 2-core machine the 8 ranks time-share the cores: the ranking of grids reflects how much
each grid communicates and waits under that contention, not what 8 real devices would do.

Run: ``python experiments/grids.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from scaling import COMM, COMPUTE  # noqa: E402

NAME = "grids"
COLUMNS = ["grid", "dp", "pp", "tp", "tokens_per_s", "step_ms", "compute_ms", "pp_share",
           "tp_share", "dp_share", "world_share", "idle_share", "bubble", "mem_measured_MiB",
           "mem_predicted_MiB", "mem_worst_error_pct", "mem_rank_errors_pct", "mem_runtime_MiB"]


def grids(world: int) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) with dp * pp * tp = world, dp-heavy first."""
    out = []
    for dp in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
        rest = world // dp
        for pp in sorted(p for p in range(1, rest + 1) if rest % p == 0):
            out.append((dp, pp, rest // pp))
    return out


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--world", type=int, default=None, help="ranks per grid (default 8; 2 quick)")
    args = ap.parse_args(argv)
    out = common.out_dir(args, NAME)
    config = common.CONFIGS / "exp_scale.toml"
    world = args.world or (2 if args.quick else 8)
    steps = args.steps or (2 if args.quick else 3)
    n_layer, m = (4, 2) if args.quick else (8, 4)
    base = {"train.steps": steps, "train.batch_size": 32, "parallel.microbatches": m,
            "parallel.partition": "explicit"}
    if args.quick:
        base.update({"model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2,
                     "train.seq_len": 16, "train.batch_size": 8})

    from mpipar.analysis import breakdown

    rows = []
    for dp, pp, tp in grids(world):
        sets = dict(base, **{"parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp,
                             "parallel.boundaries": common.balanced_boundaries(n_layer, pp)})
        path = common.train(out / f"dp{dp}_pp{pp}_tp{tp}", world, config, sets, args)
        res = breakdown(path)
        s, r = res["summary"], res["ranks"]
        st = r["step_time"]
        row = {"grid": f"{dp}x{pp}x{tp}", "dp": dp, "pp": pp, "tp": tp,
               "tokens_per_s": s["tokens_per_s"], "step_ms": 1e3 * s["step_time"],
               "compute_ms": 1e3 * float(sum(r[f"self_{k}"] for k in COMPUTE).mean()),
               "idle_share": float((r["idle"] / st).mean()), "bubble": s["bubble"]}
        for a in COMM:
            row[f"{a}_share"] = float((r[f"self_{a}"] / st).mean())
        row.update(memory_columns(s, r))
        rows.append(row)
    common.write_results(out, f"every {world}-rank grid (dp x pp x tp), same model", rows,
                         COLUMNS, meta={"config": str(config), "steps": steps, "world": world,
                                        "microbatches": m, "quick": args.quick,
                                        **common.machine_note()})
    plot(rows, out / f"{NAME}.png", world)
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def memory_columns(summary: dict, ranks: dict) -> dict:
    """Measured and predicted peak memory of a grid: the largest measured rank beside its
    stage's prediction, and the worst relative error over every rank (None: not recorded)."""
    measured = summary.get("memory_measured")
    pred = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    predicted = pred.get("memory")
    if not measured or not predicted:
        return {"mem_measured_MiB": None, "mem_predicted_MiB": None, "mem_worst_error_pct": None,
                "mem_rank_errors_pct": None, "mem_runtime_MiB": None}
    errors = [100 * (predicted[int(p)] - got) / got for got, p in zip(measured, ranks["pp"],
                                                                       strict=True)]
    top = max(range(len(measured)), key=lambda i: measured[i])
    runtime = [r.get("runtime", 0) for r in pred.get("memory_parts") or []]
    return {"mem_measured_MiB": measured[top] / 2**20,
            "mem_predicted_MiB": predicted[int(ranks["pp"][top])] / 2**20,
            "mem_worst_error_pct": max(errors, key=abs),
            "mem_rank_errors_pct": " ".join(f"{e:+.1f}" for e in errors),
            "mem_runtime_MiB": max(runtime, default=0) / 2**20}


def plot(rows, path, world):
    import numpy as np

    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [r["grid"] for r in rows]
    x = np.arange(len(rows))
    ax1.bar(x, [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"throughput on each {world}-rank grid (dp x pp x tp)")
    bottom = np.zeros(len(rows))
    parts = [("compute", [r["compute_ms"] / r["step_ms"] for r in rows])]
    parts += [(f"{a} comm", [r[f"{a}_share"] for r in rows]) for a in COMM]
    parts += [("idle", [r["idle_share"] for r in rows])]
    for name, vals in parts:
        ax2.bar(x, vals, bottom=bottom, label=name)
        bottom += np.array(vals)
    ax2.set_ylabel("share of the step (mean over ranks, self time)")
    ax2.set_title("where each rank's step went")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (ax1, ax2):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
