"""Chrome Trace Event Format export (chrome://tracing, Perfetto) of a dump and of its prediction.

One process (``pid``) per run, one thread (``tid``) per rank: the measured run is process 1
("measured"), the simulator's timeline of the same configuration on the fitted cost model is
process 2 ("predicted", one thread per pipeline rank). Every event is a complete slice
(``"ph": "X"``) with ``ts`` and ``dur`` in microseconds; micro-batch, chunk, bytes and peer go in
``args``; ``cat`` is ``compute`` or ``comm`` (a kind with an axis prefix, ``pp.send``), or
``other``. Zero-length markers (``mem.*``) become counters (``"ph": "C"``).
Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import numpy as np

from .dump import Run

MEASURED_PID, PREDICTED_PID = 1, 2
COMPUTE = ("F", "B", "W", "R", "LOSS", "OPT", "BW", "UPDATE")


def _cat(kind: str) -> str:
    if kind in COMPUTE:
        return "compute"
    if "." in kind:
        return "comm"
    return "other"


def _meta(pid: int, name: str, threads: dict) -> list[dict]:
    out = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
           {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index",
            "args": {"sort_index": pid}}]
    for tid, label in threads.items():
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                    "args": {"name": label}})
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                    "args": {"sort_index": tid}})
    return out


def measured_events(run: Run, steps=None, pid: int = MEASURED_PID) -> list[dict]:
    """Every event of every rank (of ``steps``, default all), on one thread per world rank."""
    out = _meta(pid, f"measured: {run.name}", {r: run.label(r) for r in range(run.world_size)})
    per_rank = [ev if steps is None else ev[np.isin(ev["step"], list(steps))]
                for ev in run.events]
    # time 0 = the first selected event, so a step lines up with its prediction
    t0 = min((float(e["start"].min()) for e in per_rank if e.size), default=0.0)
    for r, ev in enumerate(per_rank):
        for e in ev:
            kind = str(e["kind"])
            ts = 1e6 * (float(e["start"]) - t0)
            if kind.startswith("mem."):
                out.append({"ph": "C", "pid": pid, "tid": r, "ts": ts, "name": f"{kind} r{r}",
                            "args": {"MiB": int(e["bytes"]) / 2**20}})
                continue
            args = {"step": int(e["step"]), "mb": int(e["mb"]), "chunk": int(e["chunk"])}
            if e["bytes"]:
                args["bytes"] = int(e["bytes"])
            if e["peer"] >= 0:
                args["peer"] = int(e["peer"])
            out.append({"ph": "X", "pid": pid, "tid": r, "ts": ts,
                        "dur": 1e6 * float(e["end"] - e["start"]), "name": kind,
                        "cat": _cat(kind), "args": args})
    return out


def predicted_events(sim, name: str = "predicted", pid: int = PREDICTED_PID) -> list[dict]:
    """The simulator's timeline (``SimResult``): one thread per pipeline rank."""
    out = _meta(pid, name, {r: f"pp{r}" for r in range(len(sim.timeline))})
    for r, tl in enumerate(sim.timeline):
        for start, end, a in tl:
            comm = a.op.startswith(("SEND", "RECV"))
            out.append({"ph": "X", "pid": pid, "tid": r, "ts": 1e6 * start,
                        "dur": 1e6 * (end - start), "name": a.op,
                        "cat": "comm" if comm else "compute",
                        "args": {"mb": a.mb, "chunk": a.chunk}})
        for start, end, c in (sim.dp_timeline[r] if r < len(sim.dp_timeline) else []):
            out.append({"ph": "X", "pid": pid, "tid": r, "ts": 1e6 * start,
                        "dur": 1e6 * (end - start), "name": "dp.reduce", "cat": "comm",
                        "args": {"mb": -1, "chunk": c}})
    return out


def predicted_for(run: Run, steps):
    """The simulator's run of this dump's configuration on the cost model fitted from it."""
    from .flops import setting as get
    from .predict import run_model

    kind, m = get(run.config, "schedule"), get(run.config, "microbatches")
    if kind is None or m is None:
        raise ValueError(f"{run.path}: config has no schedule/microbatches to predict")
    v = int(get(run.config, "virtual_stages", 1) or 1)
    return run_model(run, steps, kind, int(run.grid["pp"]), int(m), v)[3]


def write(path, events: list[dict]) -> None:
    """The JSON object format (``traceEvents``), written atomically."""
    from ..files import write_json_atomic

    write_json_atomic(path, {"traceEvents": events, "displayTimeUnit": "ms"})
