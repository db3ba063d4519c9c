"""Experiment 2b: the memory model's predicted peak per rank beside the measured one.

Each configuration trains a few steps with ``mpipar train`` (under mpiexec) on a small GPT (4
blocks of width 128, 4 heads, vocabulary 256, batch 32 x 128 tokens: activations of tens of
MiB, so that the allocator's few MiB of history are small beside them) or an MLP; the trainer
records ``mem.static`` / ``mem.base`` / ``mem.peak`` (``mpipar/training/memory.py``) and
``mpipar.analysis.predict.measured_memory`` turns them into the measured peak per rank: the state
(parameters, gradients, optimizer state) counted exactly plus the resident high-water mark the
steps add above set-up. ``mpipar.analysis.memory_model.predict_run`` predicts it from the config
and the simulated schedule alone. Per pipeline rank (world ranks of one stage averaged): measured
and predicted MiB, the error, and the predicted parts (state, activations, working set,
buffers, the timing dump). Memory is not time: the numbers do not depend on the machine's load.

Run: ``python experiments/memory_peak.py [--quick] [--out DIR] [--steps S]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "memory_peak"
COLUMNS = ["config", "ranks", "pp_rank", "measured_MiB", "predicted_MiB", "error_pct",
           "traced_MiB", "traced_error_pct", "state_MiB", "activations_MiB", "work_MiB",
           "buffers_MiB", "timing_dump_MiB"]
MiB = 2.0**20
GPT = {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.block_size": 128,
       "train.batch_size": 32, "train.seq_len": 128, "parallel.partition": "explicit"}
MLP = {"model.sizes": [784, 1024, 1024, 1024, 1024, 10], "train.batch_size": 256}


def _pp(pp, schedule, m, v=1, **extra):
    sets = {"parallel.pp": pp, "parallel.schedule": schedule, "parallel.microbatches": m,
            "parallel.virtual_stages": v,
            "parallel.boundaries": common.balanced_boundaries(4, pp * v)}
    sets.update(extra)
    return sets


def configs(quick: bool) -> list:
    """(label, ranks, config file, --set overrides)."""
    gpt = common.CONFIGS / "exp_bubble.toml"
    if quick:
        return [("gpt pp=2 1f1b m=4", 2, gpt, {**GPT, **_pp(2, "1f1b", 4)})]
    rows = [("gpt 1 rank m=4", 1, gpt, {**GPT, **_pp(1, "1f1b", 4)})]
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        for m in (4, 8):
            label = f"gpt pp=2 {sched}{' v=2' if v > 1 else ''} m={m}"
            rows.append((label, 2, gpt, {**GPT, **_pp(2, sched, m, v)}))
    rows += [
        ("gpt pp=2 1f1b m=4 recompute full", 2, gpt,
         {**GPT, **_pp(2, "1f1b", 4, **{"parallel.recompute": True})}),
        ("gpt pp=2 1f1b m=4 recompute selective", 2, gpt,
         {**GPT, **_pp(2, "1f1b", 4, **{"parallel.recompute": "selective"})}),
        ("gpt tp=2 m=4", 2, gpt, {**GPT, **_pp(1, "1f1b", 4), "parallel.tp": 2}),
        ("gpt tp=2 m=4 sequence parallel", 2, gpt,
         {**GPT, **_pp(1, "1f1b", 4), "parallel.tp": 2, "parallel.sequence_parallel": True}),
        ("gpt dp=2 m=4", 2, gpt, {**GPT, **_pp(1, "1f1b", 4), "parallel.dp": 2}),
        ("gpt dp=2 m=4 zero1", 2, gpt,
         {**GPT, **_pp(1, "1f1b", 4), "parallel.dp": 2, "parallel.zero1": True}),
        ("mlp pp=2 1f1b m=4", 2, common.CONFIGS / "mlp.toml",
         {**MLP, "parallel.pp": 2, "parallel.microbatches": 4}),
    ]
    return rows


def run_driver(run_dir: Path, ranks: int, config: Path, sets: dict, args) -> Path:
    """Train under ``memory_driver.py`` (tracemalloc on): the trainer's own ``mem.*`` events
    and the NumPy-tracked bytes (``memory`` rank attribute) in one dump."""
    if not (args.reuse and common.complete_dump(run_dir)):
        cmd = ["mpiexec", "-n", str(ranks), sys.executable,
               str(Path(__file__).resolve().parent / "memory_driver.py"),
               "--config", str(config), "--out", str(run_dir), "--steps", str(args.steps or 3)]
        for k, val in sets.items():
            cmd += ["--set", f"{k}={common._value(val)}"]
        common.run_command(cmd, args.timeout, run_dir.name)
    return run_dir / "trace.h5"


def traced_memory(run) -> list[float]:
    """Per world rank: ``mem.static`` + the NumPy-tracked peak the steps added above set-up."""
    import json

    out = []
    for r, ev in enumerate(run.events):
        static = float(ev[ev["kind"] == "mem.static"]["bytes"].max())
        mem = json.loads(run.rank_attrs[r]["memory"])
        out.append(static + mem["traced_max_peak"] - mem["traced_setup"])
    return out


def rows_of(label, run) -> list[dict]:
    """Measured beside predicted, one row per pipeline rank."""
    import numpy as np

    from mpipar.analysis.breakdown import select_steps
    from mpipar.analysis.memory_model import predict_run
    from mpipar.analysis.predict import events_per_step, measured_memory

    measured = measured_memory(run)
    # the timing dump's part too: the run's own events per step (memory_model's "trace")
    predicted = predict_run(run.config, run.grid,
                            events_per_step(run, select_steps(run)[0]))
    if measured is None or predicted is None:
        raise common.ExperimentError(f"{label}: no memory events or no model for this config")
    traced = np.asarray(traced_memory(run))
    stage = np.array([int(c[1]) for c in run.coords])
    out = []
    for p, pred in enumerate(predicted):
        got = float(np.mean(np.asarray(measured)[stage == p]))
        numpy_got = float(np.mean(traced[stage == p]))
        state = pred["params"] + pred["grads"] + pred["optimizer"]
        out.append({"config": label, "ranks": run.world_size, "pp_rank": p,
                    "measured_MiB": got / MiB, "predicted_MiB": pred["total"] / MiB,
                    "error_pct": 100 * (pred["total"] - got) / got,
                    "traced_MiB": numpy_got / MiB,
                    "traced_error_pct": 100 * (pred["total"] - numpy_got) / numpy_got,
                    "state_MiB": state / MiB, "activations_MiB": pred["activations"] / MiB,
                    "work_MiB": pred["work"] / MiB, "buffers_MiB": pred["buffers"] / MiB,
                    "timing_dump_MiB": pred.get("trace", 0) / MiB})
    return out


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    steps = args.steps or 3

    from mpipar.analysis import load

    rows = []
    for label, ranks, config, sets in configs(args.quick):
        run_dir = out / "".join(ch if ch.isalnum() else "_" for ch in label)
        rows += rows_of(label, load(run_driver(run_dir, ranks, config, sets, args)))
    common.write_results(out, "predicted vs measured peak memory per pipeline rank", rows,
                         COLUMNS, meta={"steps": steps, "quick": args.quick,
                                        **common.machine_note()})
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"largest error {worst:.1f} %; rows beyond 15 %: "
          f"{sum(abs(r['error_pct']) > 15 for r in rows)} of {len(rows)}")
    plot(rows, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def plot(rows, path):
    """One bar group per (configuration, pipeline rank): the predicted parts stacked (state,
    activations, working set, buffers) beside the measured resident and NumPy-tracked peaks."""
    import numpy as np

    plt = common.pyplot()
    labels = [f"{r['config']} [pp{r['pp_rank']}]" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows) + 3), 6))
    bottom = np.zeros(len(rows))
    for key, name in (("state_MiB", "state"), ("activations_MiB", "activations"),
                      ("work_MiB", "working set"), ("buffers_MiB", "buffers")):
        h = np.array([r[key] for r in rows])
        ax.bar(x - 0.2, h, 0.4, bottom=bottom, label=f"predicted: {name}")
        bottom += h
    ax.bar(x + 0.2, [r["measured_MiB"] for r in rows], 0.4, color="0.7",
           label="measured (resident)")
    ax.plot(x + 0.2, [r["traced_MiB"] for r in rows], "k_", markersize=12, mew=2, ls="",
            label="measured (NumPy-tracked)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("peak MiB per rank")
    within = sum(abs(r["error_pct"]) <= 15 for r in rows)
    ax.set_title(f"predicted (left, stacked) beside measured (right) peak memory: "
                 f"{within} of {len(rows)} within 15 %")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
