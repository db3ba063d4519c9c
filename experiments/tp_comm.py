"""Experiment 3: tensor-parallel communication volume and time against tp, with and without
sequence parallelism.

For tp = 1, 2, 4 (dp = pp = 1) it trains the GPT of experiments/configs/exp_tp.toml and sums,
per rank and step, the ``tp.*`` events of the dump:

- ``calls``, ``payload_MiB``: the collectives and the bytes they were handed (an all-reduce or
  reduce-scatter records its full input, an all-gather its local shard);
- ``wire_MiB``: what a ring algorithm moves per rank for those calls (all-reduce 2(t-1)/t n,
  reduce-scatter (t-1)/t n, all-gather (t-1) n_shard);
- ``pred_wire_MiB``: Megatron's count: per micro-batch, each block does 2 activation-sized
  all-reduces forward and 2 backward (with sequence parallelism each becomes a reduce-scatter
  plus an all-gather: the same volume), the vocab-parallel embedding and head one each, and the
  vocab-parallel loss 3 scalars per token (the gradient norm goes with the loss in one world
  all-reduce, not over tp);
- ``tp_ms`` (inclusive time in tp collectives), ``tp_share`` (their self time / step time).

Run: ``python experiments/tp_comm.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "tp_comm"
COLUMNS = ["tp", "sp", "calls", "payload_MiB", "wire_MiB", "pred_wire_MiB", "tp_ms",
           "tp_share", "compute_ms", "step_ms", "tokens_per_s"]
MiB = 2.0**20


def wire_bytes(kind: str, nbytes: float, t: int) -> float:
    """Bytes a rank sends in a ring implementation of the collective."""
    if kind == "tp.allreduce":
        return 2 * (t - 1) / t * nbytes
    if kind == "tp.reduce_scatter":
        return (t - 1) / t * nbytes
    if kind == "tp.allgather":
        return (t - 1) * nbytes
    return nbytes


def predicted_wire(cfg: dict, t: int) -> float:
    m, tr = cfg["model"], cfg["train"]
    if t == 1:
        return 0.0
    item = 8 if tr["dtype"] == "float64" else 4
    tokens = tr["batch_size"] * tr["seq_len"]
    act = tokens * m["n_embd"] * item
    n_act = 4 * m["n_layer"] + 2  # all-reduce equivalents per step (all micro-batches)
    # the gradient norm's partial sum is not a tp collective: it goes with the loss over world
    return 2 * (t - 1) / t * (n_act * act + 3 * tokens * item)


def tp_stats(run, steps) -> dict:
    import numpy as np

    t = int(run.grid["tp"])
    calls, payload, wire = [], [], []
    for ev in run.events:
        ev = ev[np.isin(ev["step"], steps)]
        tp = ev[np.char.startswith(ev["kind"], "tp.")]
        calls.append(tp.size / len(steps))
        payload.append(tp["bytes"].sum() / len(steps))
        wire.append(sum(wire_bytes(k, b, t) for k, b in zip(tp["kind"], tp["bytes"],
                                                             strict=True)) / len(steps))
    return {"calls": float(np.mean(calls)), "payload": float(np.mean(payload)),
            "wire": float(np.mean(wire))}


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    config = common.CONFIGS / "exp_tp.toml"
    steps = args.steps or (2 if args.quick else 4)
    base = {"train.steps": steps}
    tps = (1, 2) if args.quick else (1, 2, 4)
    if args.quick:
        base.update({"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2,
                     "train.seq_len": 16, "train.batch_size": 8})

    from mpipar.analysis import breakdown, load

    rows = []
    for t in tps:
        for sp in ((False,) if t == 1 else (False, True)):
            run_dir = out / f"tp{t}{'_sp' if sp else ''}"
            sets = dict(base, **{"parallel.tp": t, "parallel.sequence_parallel": sp})
            path = common.train(run_dir, t, config, sets, args)
            run = load(path)
            res = breakdown(run)
            s, ranks = res["summary"], res["ranks"]
            st = tp_stats(run, res["steps"])
            compute = sum(ranks[k] for k in ("F", "B", "W", "R", "LOSS", "OPT"))
            rows.append({
                "tp": t, "sp": sp, "calls": st["calls"], "payload_MiB": st["payload"] / MiB,
                "wire_MiB": st["wire"] / MiB,
                "pred_wire_MiB": predicted_wire(run.config, t) / MiB,
                "tp_ms": 1e3 * float(ranks["comm_tp"].mean()),
                "tp_share": float((ranks["self_tp"] / ranks["step_time"]).mean()),
                # inclusive: a collective inside F counts here too (tp_ms says how much)
                "compute_ms": 1e3 * float(compute.mean()),
                "step_ms": 1e3 * s["step_time"], "tokens_per_s": s["tokens_per_s"],
            })
    common.write_results(out, "tensor-parallel communication per rank and step", rows, COLUMNS,
                         meta={"config": str(config), "steps": steps, "quick": args.quick,
                               **common.machine_note()})
    plot(rows, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def plot(rows, path):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for sp, style in ((False, "o-"), (True, "s--")):
        sel = sorted((r["tp"], r) for r in rows if r["sp"] == sp or (r["tp"] == 1))
        xs = [p[0] for p in sel]
        lab = "sequence parallel" if sp else "all-reduce (Megatron)"
        ax1.plot(xs, [p[1]["wire_MiB"] for p in sel], style, label=f"{lab} measured")
        ax2.plot(xs, [100 * p[1]["tp_share"] for p in sel], style, label=lab)
    preds = sorted({(r["tp"], r["pred_wire_MiB"]) for r in rows})
    ax1.plot([p[0] for p in preds], [p[1] for p in preds], "k:", label="predicted (both)")
    ax1.set_ylabel("MiB sent per rank per step (ring estimate)")
    ax2.set_ylabel("% of step time in tp collectives (self time)")
    for ax in (ax1, ax2):
        ax.set_xlabel("tp")
        ax.set_xticks(sorted({r["tp"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
