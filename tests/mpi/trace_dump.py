"""Dump round trip: every rank traces and writes its part, rank 0 the index; rank 0 reads
them back against the schema (version 2: index + trace.parts/rank-<r>.h5).

Run: mpiexec -n N python tests/mpi/trace_dump.py PATH DP PP TP
The run flushes twice (the second flush appends only step 1's events, and the first flush's
own dump.flush event) and ends with complete=True.
"""

import json
import os
import sys

import h5py
import numpy as np

from mpipar.mpi import ProcessGrid, dump_trace, failfast, grid_layout
from mpipar.trace import EVENT_DTYPE, METRICS_DTYPE, Tracer

failfast.install()
path = sys.argv[1]
dp, pp, tp = (int(a) for a in sys.argv[2:5])
tracer = Tracer(enabled=True)
g = ProcessGrid(dp, pp, tp, tracer=tracer)
g.world_comm.barrier()
tracer.reset_clock()
me = g.rank
config = {"model": "mlp", "seed": 7, "dp": dp, "pp": pp, "tp": tp}

for step in range(2):
    tracer.step = step
    with tracer.region("STEP"):
        for mb in range(3):
            with tracer.region("F", mb=mb, chunk=0):
                np.sqrt(np.arange(1000.0) + me)
        g.world_comm.allreduce(np.full(4, me + 1.0))
    if me == 0:
        tracer.add_metrics(step=step, loss=1.0 / (step + 1), lr=1e-3, tokens=128, step_time=0.1)
    dump_trace(tracer, g, path, {"config": config, "complete": step == 1}, rank_attrs={"extra": me})
    # a flush forgets its rows; it leaves only its own timing, for the next flush
    assert [k.decode() for k in tracer.events()["kind"]] == ["dump.flush"], tracer.events()
    assert len(tracer.metrics()) == 0, "a flush forgets its rows"

g.world_comm.barrier()  # every part written before rank 0 reads them
if me == 0:
    with h5py.File(path, "r") as f:
        a = f.attrs
        assert a["schema_version"] == 2, a["schema_version"]
        assert a["world_size"] == g.world_size
        assert bool(a["complete"]) is True, "final dump must say complete"
        assert json.loads(a["config"]) == config, a["config"]
        assert json.loads(a["grid"]) == {"dp": dp, "pp": pp, "tp": tp, "order": "tp-dp-pp"}
        run_id = a["run_id"]
        assert a["parts"] == "trace.parts" and "ranks" not in f, list(f)
        versions = json.loads(a["versions"])
        for key in ("python", "numpy", "cupy", "mpi4py", "mpi_library", "h5py", "mpipar"):
            assert versions.get(key), f"versions lacks {key}: {versions}"
        assert isinstance(a["git_commit"], str) and a["git_commit"], a["git_commit"]
        assert "T" in a["start_time"], a["start_time"]
    folder = os.path.join(os.path.dirname(path), "trace.parts")
    assert sorted(os.listdir(folder)) == [f"rank-{r:05d}.h5" for r in range(g.world_size)]
    layout = grid_layout(dp, pp, tp)
    for r in range(g.world_size):
        with h5py.File(os.path.join(folder, f"rank-{r:05d}.h5"), "r") as grp:
            assert grp.attrs["run_id"] == run_id and grp.attrs["schema_version"] == 2
            assert bool(grp.attrs["complete"]) is True
            assert tuple(int(grp.attrs[k]) for k in ("dp", "pp", "tp")) == layout[r], r
            assert grp.attrs["hostname"] == g.hostnames[r] and grp.attrs["device"] == "cpu"
            assert grp.attrs["extra"] == r
            committed = json.loads(grp.attrs["committed"])
            ev = grp["events"][: committed["events"]]
            assert ev.dtype == EVENT_DTYPE, ev.dtype
            kinds = [k.decode() for k in ev["kind"]]
            assert kinds.count("F") == 6 and kinds.count("STEP") == 2, kinds
            flush = ev[ev["kind"] == b"dump.flush"]  # the first flush's, written by the second
            assert len(flush) == 1 and flush["step"][0] == -1, flush
            if g.world_size > 1:
                assert kinds.count("world.allreduce") == 2, kinds
                red = ev[ev["kind"] == b"world.allreduce"]
                assert list(red["bytes"]) == [32, 32] and list(red["peer"]) == [-1, -1], red
            fwd = ev[ev["kind"] == b"F"]
            assert list(fwd["mb"]) == [0, 1, 2, 0, 1, 2] and list(fwd["step"]) == [0] * 3 + [1] * 3
            assert np.all(ev["end"] >= ev["start"]) and np.all(ev["start"] >= 0), ev
            assert not any(k.startswith("world.broadcast") for k in kinds), "the dump traced itself"
            m = grp["metrics"][: committed["metrics"]]
            assert m.dtype == METRICS_DTYPE, m.dtype
            if r == 0:  # rank 0's metrics are the run's; the other parts hold none
                assert list(m["step"]) == [0, 1], m
                assert np.isnan(m["val_loss"]).all() and list(m["tokens"]) == [128, 128], m
            else:
                assert len(m) == 0, m
    from mpipar.analysis import load

    run = load(path)
    assert run.complete and run.world_size == g.world_size and list(run.metrics["step"]) == [0, 1]
    assert run.attrs["hostnames"] == g.hostnames
    print(f"trace_dump OK on {g.world_size} ranks: {path}")
