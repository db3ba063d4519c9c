"""Realistic timing dumps of any size (ranks, steps, schedule, grid), for benchmarks and tests.

One step of the schedule is simulated once (the pure simulator on a few unit costs), giving
each pipeline stage a template of the events a real rank records in a step: ``STEP``, the
receives (``pp.recv`` post, ``pp.wait``), ``F``/``B``/``W`` (two ``tp.allreduce`` inside each
when tp > 1), ``pp.send`` posts with their completion waits, the gradient reduction
(``dp.allreduce`` post + ``dp.wait`` when dp > 1), ``world.allreduce`` inside ``OPT``, and a
``mem.peak`` marker; ``mem.static``/``mem.base`` once at the start. Every step repeats its
stage's template, stretched by a per-step factor, each compute shortened by its own random
share of its slot (units vary, slots stay ordered, as measured ones do). Built with numpy,
rank by rank, written as schema-1 files (``synthetic.write``'s layout; ``mpipar analyze``
reads every layout), one rank's events in memory at a time: a 1,024-rank x 1,000-step 1F1B run
at pp = 4, m = 4, tp = 1 holds about 39 M events (38 a rank and step).
"""

from __future__ import annotations

import json

import numpy as np

from .synthetic import DISK_EVENT_DTYPE, DISK_METRICS_DTYPE, gpt_config

# unit costs of the simulated step (seconds): forward, backward, post, receive post, latency
F, B, POST, LAT = 0.010, 0.020, 20e-6, 60e-6
OPT, DP, WORLD = 0.004, 0.006, 0.001
MSG = 32768  # bytes of one activation message


def stage_templates(kind: str, pp: int, m: int, tp: int, dp: int, v: int = 1) -> list:
    """Per pipeline stage p: (kinds, mb, chunk, start, end, bytes, peer stage offset, is
    compute) arrays of one step, times relative to the step start."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import CostModel, simulate

    sched = lower(build_schedule(kind, pp, m, virtual_stages=v))
    unit = {"F": F / v, "B": B / v, "BW": B / v, "W": B / v / 2, "R": 0.0}
    sim = simulate(sched, CostModel(unit=unit, latency=LAT, send_post=POST, recv_post=POST))
    pipe_end = max(b for tl in sim.timeline for _, b, _ in tl)
    out = []
    for tl in sim.timeline:
        rows = []  # (kind, mb, chunk, start, end, bytes, peer stage, compute)
        sends = []
        for a, b, act in tl:
            op = act.op
            if op in ("F", "B", "BW", "W", "R"):
                name = "B" if op == "BW" else op
                rows.append((name, act.mb, act.chunk, a, b, 0, -1, True))
                for k in range(2 if tp > 1 else 0):  # the layer's collectives inside the unit
                    t0 = a + (b - a) * (0.2 + 0.4 * k)
                    rows.append(("tp.allreduce", -1, -1, t0, t0 + (b - a) * 0.1, MSG, -1, False))
            elif op.startswith("RECV"):
                src = act.chunk - 1 if op == "RECV_F" else act.chunk + 1
                peer = sched.rank_of(src)
                rows.append(("pp.recv", act.mb, act.chunk, a, a + POST / 2, MSG, peer, False))
                rows.append(("pp.wait", act.mb, act.chunk, a + POST / 2, max(b, a + POST), MSG,
                             peer, False))
            elif op.startswith("SEND"):
                dst = act.chunk + 1 if op == "SEND_F" else act.chunk - 1
                peer = sched.rank_of(dst)
                rows.append(("pp.send", act.mb, act.chunk, a, a + POST, MSG, peer, False))
                sends.append((act.mb, act.chunk, peer))
        t = pipe_end
        for mb, c, peer in sends:  # the sends' completions, tested after the last unit
            rows.append(("pp.wait", mb, c, t, t + 2e-6, MSG, peer, False))
            t += 3e-6
        if dp > 1:
            rows.append(("dp.allreduce", -1, -1, t, t + 1e-4, 1 << 20, -1, False))
            rows.append(("dp.wait", -1, -1, t + 1e-4, t + DP, 1 << 20, -1, False))
            t += DP
        rows.append(("OPT", -1, -1, t, t + OPT, 0, -1, False))
        rows.append(("world.allreduce", -1, -1, t + OPT * 0.1, t + OPT * 0.1 + WORLD, 16, -1,
                     False))
        rows.append(("STEP", -1, -1, 0.0, t + OPT + 1e-5, 0, -1, False))
        rows.append(("mem.peak", -1, -1, t + OPT + 2e-5, t + OPT + 2e-5, 64 << 20, -1, False))
        cols = list(zip(*rows, strict=True))
        out.append(tuple(np.array(c) for c in cols))
    return out


def rank_events(template, world_of_stage, steps: int, step_starts, stretch, rng) -> np.ndarray:
    """One rank's events over ``steps`` from its stage's template (schema dtype, time order)."""
    kinds, mb, chunk, start, end, nbytes, peer_stage, compute = template
    k = len(kinds)
    ev = np.empty(steps * k + 2, dtype=DISK_EVENT_DTYPE)
    head, body = ev[:2], ev[2:]
    head["kind"] = [b"mem.static", b"mem.base"]
    head["step"], head["mb"], head["chunk"] = 0, -1, -1
    head["start"] = head["end"] = 0.0
    head["bytes"], head["peer"] = [8 << 20, 32 << 20], [-1, 1]
    s = np.repeat(np.arange(steps), k)
    scale = np.repeat(stretch, k)
    t0 = np.repeat(step_starts, k)
    a = np.tile(start, steps) * scale + t0
    e = np.tile(end, steps) * scale + t0
    shrink = np.where(np.tile(compute, steps), rng.uniform(0.0, 0.3, steps * k), 0.0)
    body["kind"] = np.tile(kinds.astype("S24"), steps)
    body["step"], body["mb"], body["chunk"] = s, np.tile(mb, steps), np.tile(chunk, steps)
    body["start"], body["end"] = a, e - (e - a) * shrink
    body["bytes"] = np.tile(nbytes, steps)
    body["peer"] = np.tile(np.where(peer_stage >= 0, world_of_stage(peer_stage), -1), steps)
    return ev


def write_run(path, dp: int = 1, pp: int = 2, tp: int = 1, steps: int = 10,
              schedule: str = "1f1b", microbatches: int = 4, seed: int = 0,
              compression=None) -> dict:
    """Write a realistic schema-1 dump of a dp x pp x tp run (world ranks tp fastest, then dp,
    then pp: the trainer's default ``tp-dp-pp``); return {"events": total, "ranks": world}."""
    import h5py

    world = dp * pp * tp
    rng = np.random.default_rng(seed)
    templates = stage_templates(schedule, pp, microbatches, tp, dp)
    step_len = max(float(t[4].max()) for t in templates)
    stretch = 1.0 + 0.05 * rng.standard_normal(steps).clip(-3, 3)
    starts = np.concatenate([[0.0], np.cumsum(step_len * stretch + 1e-3)[:-1]])
    grid = {"dp": dp, "pp": pp, "tp": tp, "order": "tp-dp-pp"}
    cfg = gpt_config(microbatches=microbatches, schedule=schedule, batch_size=8 * microbatches)
    total = 0
    with h5py.File(path, "w") as f:
        attrs = {"schema_version": 1, "config": json.dumps(cfg), "grid": json.dumps(grid),
                 "world_size": world, "hostnames": json.dumps(["localhost"] * world),
                 "devices": json.dumps(["cpu"] * world), "versions": json.dumps({}),
                 "git_commit": "synthetic", "start_time": "2026-01-01T00:00:00+00:00",
                 "complete": True}
        f.attrs.update(attrs)
        counts = []
        for r in range(world):
            t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
            ev = rank_events(templates[p], lambda q, d=d, t=t: q * dp * tp + d * tp + t, steps,
                             starts, stretch, rng)
            g = f.create_group(f"ranks/{r}")
            g.create_dataset("events", data=ev, chunks=(min(len(ev), 16384),),
                             compression=compression)
            g.attrs.update({"dp": d, "pp": p, "tp": t, "hostname": "localhost", "device": "cpu"})
            counts.append(len(ev))
            total += len(ev)
        f.attrs["committed"] = json.dumps({"events": counts, "metrics": 0})
        f.create_dataset("metrics", data=np.empty(0, dtype=DISK_METRICS_DTYPE))
    return {"events": total, "ranks": world}
