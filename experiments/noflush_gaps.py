"""Where a continuous run's time goes, per rank, measured beside its calibrated simulation.

usage: python experiments/noflush_gaps.py RUN_DIR [RUN_DIR ...]

For each rank of a continuous run (PipeDream / 2BW without a flush), ms per step over the
measured steps: the rank's call (its share of a step), model compute (F, B, W, LOSS), waiting
in receives for the forward's activations (``pp.wait`` of a forward) and for the backward's
gradients, the weight-version work (STASH), the per-micro-batch optimizer (OPT), the lagged
reduction (world.*), the rest of the call that no event covers, and the time between calls
(the training loop's own work); median and mean per step, so a rare stall (a dump flush) shows
as a mean far above the median. Beside each measured figure, the same from the calibrated
simulation of the run (``analysis.predict_continuous``, jitter-free): the term the simulation
lacks is the row where the two part. Then the run's five longest stalls between a rank's
consecutive events, with the events around them.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

COMPUTE = ("F", "B", "W", "R", "LOSS")


def measured(run, steps) -> dict:
    """{(rank, term): [ms per call]} from the dump."""
    out = defaultdict(list)
    for r, ev in enumerate(run.events):
        marks = ev[ev["kind"] == "STEP"]
        calls = []
        for s in steps:
            mk = marks[marks["step"] == s]
            if not mk.size:
                continue
            lo, hi = float(mk["start"].min()), float(mk["end"].max())
            calls.append((lo, hi))
            e = ev[(ev["start"] >= lo) & (ev["end"] <= hi) & (ev["kind"] != "STEP")]
            e = e[~np.char.startswith(e["kind"].astype(str), "mem.")]
            dur = (e["end"] - e["start"]) * 1e3
            kind = e["kind"].astype(str)
            waits = kind == "pp.wait"
                    # (pp = 2, dp = tp = 1: world rank = stage; a wait for a send's completion
            # counts on its peer's side, at about zero)
            fwd = waits & (e["peer"] >= 0) & (e["peer"] < r)
            out[(r, "call")].append((hi - lo) * 1e3)
            out[(r, "compute")].append(float(dur[np.isin(kind, COMPUTE)].sum()))
            out[(r, "wait for activations")].append(float(dur[fwd].sum()))
            out[(r, "wait for gradients")].append(float(dur[waits & ~fwd].sum()))
            out[(r, "stash")].append(float(dur[kind == "STASH"].sum()))
            out[(r, "optimizer")].append(float(dur[kind == "OPT"].sum()))
            out[(r, "lagged reduction")].append(
                float(dur[np.char.startswith(kind, "world.")].sum()))
            covered = _covered(e["start"], e["end"]) * 1e3
            out[(r, "uncovered")].append((hi - lo) * 1e3 - covered)
        calls.sort()
        out[(r, "between calls")] += [(b[0] - a[1]) * 1e3 for a, b in zip(calls, calls[1:])]
    return out


def _covered(starts, ends) -> float:
    total, reach = 0.0, -np.inf
    for i in np.argsort(starts):
        s, e = float(starts[i]), float(ends[i])
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def simulated(run, steps, kind, pp, m) -> dict:
    """{(rank, term): [ms per call]} from the jitter-free calibrated simulation."""
    from mpipar.analysis.predict_continuous import _model

    _, model, _, (sim, spans), _, cuts = _model(run, steps, kind, pp, m)
    out = defaultdict(list)
    for r, tl in enumerate(sim.timeline):
        for k in steps:
            calls = tl[(cuts[r][k - 1] if k > 0 else 0):cuts[r][k]]
            out[(r, "call")].append(spans[r][k] * 1e3)
            out[(r, "compute")].append(1e3 * sum(b - a for a, b, act in calls
                                                 if act.op in ("F", "B", "W", "BW")))
            for term, op in (("wait for activations", "RECV_F"),
                             ("wait for gradients", "RECV_B")):
                out[(r, term)].append(1e3 * sum(b - a for a, b, act in calls if act.op == op))
            out[(r, "stash")].append(1e3 * sum(model.stash.get((r, act.chunk, act.op), 0.0)
                                               for _, _, act in calls))
            out[(r, "optimizer")].append(1e3 * sum(b - a for a, b, act in calls
                                                   if act.op == "UPDATE"))
            def part(name, r=r, k=k):  # the call's own where measured (``call_part``)
                return model.call_part.get((r, k, name), model.of(name, r))

            out[(r, "lagged reduction")].append(1e3 * part("sync"))
            out[(r, "uncovered")].append(1e3 * (len(calls) * part("overhead")
                                                + part("step_pre") + part("step_post")))
        out[(r, "between calls")] += [1e3 * model.call_gap.get((r, k), model.of("step_gap", r))
                                      for k in steps[:-1]]
    return out


def stalls(run, steps, n=5) -> list[str]:
    """The ``n`` longest gaps between a rank's consecutive events inside the measured steps."""
    found = []
    for r, ev in enumerate(run.events):
        ev = np.sort(ev[np.isin(ev["step"], steps) & (ev["kind"] != "STEP")], order="start")
        if ev.size < 2:
            continue
        reach = np.maximum.accumulate(ev["end"])
        gaps = ev["start"][1:] - reach[:-1]
        for i in np.argsort(gaps)[-n:]:
            found.append((float(gaps[i]), r, str(ev["kind"][i]), int(ev["step"][i]),
                          str(ev["kind"][i + 1]), int(ev["step"][i + 1])))
    found.sort(reverse=True)
    return [f"  rank {r}: {1e3 * g:7.3f} ms between {a} (step {sa}) and {b} (step {sb})"
            for g, r, a, sa, b, sb in found[:n]]


def report(path: Path) -> str:
    from mpipar.analysis import load
    from mpipar.analysis.breakdown import select_steps
    from mpipar.analysis.flops import setting as get

    run = load(str(path / "trace.h5"))
    cfg = run.config
    if not get(cfg, "continuous", False):
        return f"{path}: not a continuous run (parallel.continuous = false): nothing to compare"
    steps, _ = select_steps(run)
    kind, pp, m = get(cfg, "schedule"), int(run.coords[:, 1].max()) + 1, int(get(cfg,
                                                                               "microbatches"))
    meas, sim = measured(run, steps), simulated(run, steps, kind, pp, m)
    lines = [f"{path.name}: {kind} continuous, pp {pp}, m {m}, steps {steps[0]}-{steps[-1]}; "
             "ms per step, median / mean (simulated: jitter-free)",
             f"{'rank':>4s} {'term':22s} {'measured':>17s} {'simulated':>10s} {'diff':>8s}"]
    for r in range(run.world_size):
        for term in ("call", "compute", "wait for activations", "wait for gradients", "stash",
                     "optimizer", "lagged reduction", "uncovered", "between calls"):
            got = meas.get((r, term), [])
            want = sim.get((r, term))
            med = float(np.median(got)) if got else float("nan")
            mean = float(np.mean(got)) if got else float("nan")
            s = float(np.mean(want)) if want else float("nan")
            lines.append(f"{r:4d} {term:22s} {med:8.3f} /{mean:8.3f} {s:10.3f} "
                         f"{mean - s:+8.3f}")
    lines.append("longest stalls between a rank's consecutive events:")
    lines += stalls(run, steps)
    return "\n".join(lines)


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:]]
    if not dirs or not all((d / "trace.h5").exists() for d in dirs):
        sys.exit("usage: python experiments/noflush_gaps.py RUN_DIR [RUN_DIR ...] (each with "
                 "a trace.h5 of a continuous run, e.g. OUT/r1_tiny_m4_pipedream-cont of "
                 "noflush_ab.sh)")
    print("\n\n".join(report(d) for d in dirs))
