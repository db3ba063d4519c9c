"""Experiment 2: peak activation memory of GPipe, 1F1B, interleaved, ZB-H1, the 2023-2025
schedules (ZB-H2, ZB-V, V-Half, V-Min, looped BFS, DualPipeV) and recomputation.

Each variant trains 2 steps at pp = 4, m = 8 (the GPT of experiments/configs/exp_bubble.toml)
under ``experiments/memory_driver.py`` (started here with mpiexec), which samples every rank's
held activations after each forward / backward call. Per rank it reports:

- ``sim_peak``: the simulator's peak number of (micro-batch, chunk) pairs held;
- ``dump_peak``: the same count from the timing dump (F started, its B - or W where the schedule
  splits the backward - not finished yet): the clean proxy any ``mpipar train`` dump allows;
- ``probe_peak``: pairs actually held in the layers' saved contexts (plus recompute inputs);
- ``pair_KiB``: bytes one micro-batch leaves on one chunk after its forward;
- ``predicted_MiB`` = sim_peak x pair bytes (for recomputation: sim_peak x the chunk input's
  bytes, token ids on the first stage, plus one chunk's full context, rebuilt before each
  backward);
- ``ctx_peak_MiB``: measured peak bytes of saved contexts; ``traced_MiB``: tracemalloc's peak
  over the step above its start (activations, gradients in flight, temporaries).

The 2023-2025 schedules and PipeDream / PipeDream-2BW (``-cont``: without a flush,
``parallel.continuous``; simulated over 3 steps, the dump counted over all steps, since pairs of
two steps are in flight together) also get rows at pp = 4 and 8 with ``source`` = ``sim``: the
simulator's peak pairs per stage times the measured pair bytes scaled to the deeper cut
(pp_measured / pp: a stage holds fewer blocks), m = 2 pp.

Run: ``python experiments/memory.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "memory"
COLUMNS = ["variant", "pp", "rank", "source", "sim_peak", "dump_peak", "probe_peak", "pair_KiB",
           "predicted_MiB", "ctx_peak_MiB", "traced_MiB", "step_ms"]
NEW = ("zb-h2", "zb-v", "v-half", "v-min", "looped-bfs v=2", "dualpipev", "pipedream-2bw",
       "pipedream-cont", "pipedream-2bw-cont")  # also simulated at SIM_PPS
SIM_PPS = (4, 8)
MiB = 2.0**20


def variants(quick: bool):
    """(label, schedule, virtual, recompute)."""
    if quick:
        return [("gpipe", "gpipe", 1, False), ("1f1b", "1f1b", 1, False),
                ("1f1b+recompute", "1f1b", 1, True), ("pipedream-2bw-cont", "pipedream-2bw", 1,
                                                      False)]
    return [("gpipe", "gpipe", 1, False), ("1f1b", "1f1b", 1, False),
            ("interleaved v=2", "interleaved", 2, False), ("zb-h1", "zb-h1", 1, False),
            ("gpipe+recompute", "gpipe", 1, True), ("1f1b+recompute", "1f1b", 1, True),
            ("zb-h2", "zb-h2", 1, False), ("zb-v", "zb-v", 2, False),
            ("v-half", "v-half", 2, False), ("v-min", "v-min", 2, False),
            ("looped-bfs v=2", "looped-bfs", 2, False), ("dualpipev", "dualpipev", 2, False),
            ("pipedream-2bw", "pipedream-2bw", 1, False), ("pipedream-cont", "pipedream", 1, False),
            ("pipedream-2bw-cont", "pipedream-2bw", 1, False)]


def sim_schedule(label, sched, pp, m, v):
    """The schedule a variant runs (``-cont``: three steps without a flush)."""
    from mpipar.parallel.pipeline.generators import build_schedule

    return build_schedule(sched, pp, m, virtual_stages=v,
                          steps=3 if label.endswith("-cont") else None)


def simulated_rows(label, sched, v, pair_bytes, pp_measured):
    """Rows at SIM_PPS (m = 2 pp): simulated peak pairs x the pair bytes of the deeper cut."""
    from mpipar.parallel.pipeline.simulate import simulate

    rows = []
    for pp in SIM_PPS:
        peaks = simulate(sim_schedule(label, sched, pp, 2 * pp, v)).peak_activations
        pair = pair_bytes * pp_measured / pp
        rows += [{"variant": label, "pp": pp, "rank": r, "source": "sim", "sim_peak": n,
                  "pair_KiB": pair / 1024, "predicted_MiB": n * pair / MiB}
                 for r, n in enumerate(peaks)]
    return rows


def dump_in_flight(events, step: int) -> int:
    """Peak (mb, chunk) pairs with F started and the freeing B / W not yet finished."""
    import numpy as np

    ev = events if step is None else events[events["step"] == step]  # None: every step
    kinds = ev["kind"]
    has_w = {(int(e["step"]), int(e["mb"]), int(e["chunk"])) for e in ev[kinds == "W"]}
    deltas = []
    for e in ev[np.isin(kinds, ("F", "B", "W"))]:
        key = (int(e["step"]), int(e["mb"]), int(e["chunk"]))
        if e["kind"] == "F":
            deltas.append((float(e["start"]), 1))
        elif e["kind"] == ("W" if key in has_w else "B"):
            deltas.append((float(e["end"]), -1))
    live = peak = 0
    for _, d in sorted(deltas, key=lambda t: (t[0], t[1])):
        live += d
        peak = max(peak, live)
    return peak


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    config = common.CONFIGS / "exp_bubble.toml"
    steps = args.steps or 2
    pp, m, n_layer = (2, 4, 4) if args.quick else (4, 8, 8)
    base = {"parallel.pp": pp, "parallel.microbatches": m}
    if args.quick:
        base.update({"model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2,
                     "train.seq_len": 16, "train.batch_size": 8})

    from mpipar.analysis import breakdown, load
    from mpipar.parallel.pipeline.simulate import simulate

    rows = []
    for label, sched, v, recompute in variants(args.quick):
        run_dir = out / label.replace(" ", "_").replace("=", "").replace("+", "_")
        sets = dict(base)
        cont = label.endswith("-cont")
        sets.update({"parallel.schedule": sched, "parallel.virtual_stages": v,
                     "parallel.recompute": recompute, "parallel.continuous": cont,
                     "parallel.boundaries": common.balanced_boundaries(n_layer, pp * v)})
        if not (args.reuse and common.complete_dump(run_dir)):
            cmd = ["mpiexec", "-n", str(pp), sys.executable,
                   str(Path(__file__).resolve().parent / "memory_driver.py"),
                   "--config", str(config), "--out", str(run_dir), "--steps", str(steps)]
            for k, val in sets.items():
                cmd += ["--set", f"{k}={common._value(val)}"]
            common.run_command(cmd, args.timeout, run_dir.name)
        run = load(run_dir / "trace.h5")
        step_ms = 1e3 * breakdown(run)["summary"]["step_time"]
        sim = simulate(sim_schedule(label, sched, pp, m, v))
        last = run.steps()[-1]
        for r in range(run.world_size):
            mem = json.loads(run.rank_attrs[r]["memory"])
            pair = list(mem["pair_bytes"].values())
            pair_bytes = sum(pair) / len(pair) if pair else float("nan")
            stage = int(run.coords[r][1])
            if recompute:
                # held: one chunk input per pair; plus one chunk's context during its backward
                ins = list(mem["input_bytes"].values())
                in_bytes = sum(ins) / len(ins)
                predicted = sim.peak_activations[stage] * in_bytes + max(pair, default=0)
            else:
                predicted = sim.peak_activations[stage] * pair_bytes
            rows.append({
                "variant": label, "pp": pp, "rank": stage, "source": "measured",
                "sim_peak": sim.peak_activations[stage],
                "dump_peak": dump_in_flight(run.events[r], None if cont else last),
                "probe_peak": mem["peak_pairs"], "pair_KiB": pair_bytes / 1024,
                "predicted_MiB": predicted / MiB, "ctx_peak_MiB": mem["peak_ctx_bytes"] / MiB,
                "traced_MiB": mem["traced_step_peak"] / MiB,
                "traced_total_MiB": mem["traced_peak"] / MiB,
                "maxrss_MiB": mem["maxrss_bytes"] / MiB, "step_ms": step_ms,
            })
        if label in NEW:
            pairs = [x["pair_KiB"] * 1024 for x in rows[-run.world_size:]]
            rows += simulated_rows(label, sched, v, sum(pairs) / len(pairs), pp)
    common.write_results(out, f"activation memory per pipeline rank (pp={pp}, m={m})", rows,
                         COLUMNS, meta={"config": str(config), "pp": pp, "microbatches": m,
                                        "steps": steps, "quick": args.quick,
                                        **common.machine_note()})
    plot(rows, out / f"{NAME}.png", pp, m)
    print(f"wrote {out / (NAME + '.png')}")
    return 0


def plot(rows, path, pp, m):
    import numpy as np

    plt = common.pyplot()
    rows = [r for r in rows if r["source"] == "measured"]
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / pp
    x = np.arange(len(labels))
    for stage in range(pp):
        sel = [next(r for r in rows if r["variant"] == lab and r["rank"] == stage)
               for lab in labels]
        pos = x - 0.4 + width * (stage + 0.5)
        ax1.bar(pos, [r["ctx_peak_MiB"] for r in sel], width, label=f"stage {stage}")
        ax1.plot(pos, [r["predicted_MiB"] for r in sel], "k_", markersize=12,
                 label="predicted (sim peak x pair bytes)" if stage == 0 else None)
        ax2.bar(pos, [r["traced_MiB"] for r in sel], width, label=f"stage {stage}")
    for ax, title in ((ax1, "peak saved activations (MiB)"),
                      (ax2, "tracemalloc peak over the step (MiB)")):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_title(f"{title}, pp={pp}, m={m}")
        ax.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
