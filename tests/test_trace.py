"""The tracer and the HDF5 dump: schema round trip, atomic writes, clear errors."""

import json
import os

import h5py
import numpy as np
import pytest
from mpi_util import python_script

from mpipar.trace import (
    EVENT_DTYPE,
    METRICS_DTYPE,
    SCHEMA_VERSION,
    Tracer,
    append_dump,
    check_writable,
    rewind_dump,
    write_dump,
)


def test_schema_dtypes_match_docs():
    assert SCHEMA_VERSION == 1
    assert EVENT_DTYPE.names == ("kind", "step", "mb", "chunk", "start", "end", "bytes", "peer")
    assert [EVENT_DTYPE[n].str for n in EVENT_DTYPE.names] == [
        "|S24", "<i4", "<i4", "<i4", "<f8", "<f8", "<i8", "<i4"
    ]
    assert METRICS_DTYPE.names == (
        "step", "loss", "val_loss", "lr", "grad_norm", "tokens", "step_time"
    )


def test_region_and_record():
    t = Tracer()
    t.step = 3
    with t.region("F", mb=1, chunk=0):
        sum(range(1000))
    t.record("pp.send", 0.5, 0.75, mb=2, chunk=1, nbytes=64, peer=4)
    with pytest.raises(ZeroDivisionError):
        with t.region("B", mb=2):
            raise ZeroDivisionError("in a region")
    ev = t.events()
    assert ev.dtype == EVENT_DTYPE and len(ev) == 3
    assert list(ev["kind"]) == [b"F", b"pp.send", b"B"]  # the failing region is still recorded
    assert list(ev["step"]) == [3, 3, 3]
    assert ev[0]["end"] >= ev[0]["start"] >= 0
    assert tuple(ev[1])[1:] == (3, 2, 1, 0.5, 0.75, 64, 4)
    with pytest.raises(ValueError, match="longer than 24"):
        t.record("x" * 25, 0, 1)
    t.clear()
    assert len(t.events()) == 0


def test_record_now_is_the_unchecked_hot_path():
    t = Tracer()
    t.step = 2
    start = t.now()
    t.record_now("dp.allreduce", start, -1, -1, 32, -1)
    t.record_now("pp.send", start, 1, 0, 8, 3)
    ev = t.events()
    assert list(ev["kind"]) == [b"dp.allreduce", b"pp.send"] and list(ev["step"]) == [2, 2]
    assert tuple(ev[1])[2:4] == (1, 0) and tuple(ev[1])[6:] == (8, 3)
    assert np.all(ev["end"] >= start)
    off = Tracer(enabled=False)
    off.record_now("dp.allreduce", 0.0, -1, -1, 32, -1)
    off.sync()  # no backend: nothing to wait for
    assert len(off.events()) == 0


def test_disabled_tracer_records_nothing():
    t = Tracer(enabled=False)
    ctx = t.region("F")
    assert ctx is t.region("B", mb=3)  # one shared no-op
    with ctx:
        pass
    t.record("F", 0, 1)
    assert len(t.events()) == 0 and t.events().dtype == EVENT_DTYPE


def test_gpu_backend_synchronizes_around_regions():
    calls = []

    class FakeGPU:
        is_gpu = True

        def synchronize(self):
            calls.append(1)

    t = Tracer(backend=FakeGPU())
    with t.region("F"):
        pass
    assert len(calls) == 2  # before the start clock and before the end clock
    t.sync()
    assert len(calls) == 3


def test_metrics_rows():
    t = Tracer()
    t.add_metrics(step=0, loss=2.5, lr=1e-3, tokens=64)
    t.add_metrics(step=1, loss=2.0, val_loss=2.2, grad_norm=0.5, step_time=0.1)
    m = t.metrics()
    assert m.dtype == METRICS_DTYPE and list(m["step"]) == [0, 1]
    assert np.isnan(m["val_loss"][0]) and m["val_loss"][1] == 2.2 and m["tokens"][1] == 0
    with pytest.raises(ValueError, match="unknown metrics field"):
        t.add_metrics(step=2, accuracy=0.9)


def _events(n, seed):
    rng = np.random.default_rng(seed)
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["kind"] = [b"F", b"pp.send", b"B"][: n] if n <= 3 else b"F"
    ev["step"] = 1
    ev["mb"] = np.arange(n)
    ev["start"] = rng.uniform(0, 1, n)
    ev["end"] = ev["start"] + rng.uniform(0.1, 1, n)
    ev["bytes"] = rng.integers(1, 10**9, n)
    ev["peer"] = 1
    return ev


def test_write_dump_round_trip(tmp_path):
    path = tmp_path / "trace.h5"
    evs = [_events(3, 0), _events(0, 1)]  # a rank with no events is fine
    attrs = [{"dp": 0, "pp": 0, "tp": 0, "hostname": "a", "device": "cpu"},
             {"dp": 0, "pp": 1, "tp": 0, "hostname": "b", "device": "cuda:1"}]
    t = Tracer()
    t.add_metrics(step=0, loss=1.5)
    write_dump(path, evs, attrs, {"config": {"lr": 0.1}, "world_size": 2, "complete": True},
               metrics=t.metrics())
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == 1 and f.attrs["world_size"] == 2
        assert json.loads(f.attrs["config"]) == {"lr": 0.1} and bool(f.attrs["complete"])
        for r in range(2):
            got = f[f"ranks/{r}/events"][()]
            assert got.dtype == EVENT_DTYPE and np.array_equal(got, evs[r])
            assert dict(f[f"ranks/{r}"].attrs) == attrs[r]
        assert f["metrics"][()]["loss"][0] == 1.5
    assert os.listdir(tmp_path) == ["trace.h5"]  # no temporary file left


def test_failed_write_keeps_previous_file(tmp_path):
    path = tmp_path / "trace.h5"
    write_dump(path, [_events(2, 0)], [{"dp": 0}], {"complete": False})
    before = path.read_bytes()
    bad = np.zeros(2, dtype=[("kind", "S8")])  # not EVENT_DTYPE: fails mid-write
    with pytest.raises(ValueError, match="not EVENT_DTYPE"):
        write_dump(path, [bad], [{"dp": 0}], {"complete": True})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["trace.h5"]


def test_check_writable_messages(tmp_path):
    check_writable(tmp_path / "trace.h5")  # fine
    with pytest.raises(ValueError, match=r"cannot write the timing dump to .*not exist.*--out"):
        check_writable(tmp_path / "missing" / "trace.h5")
    with pytest.raises(ValueError, match="it is a directory"):
        check_writable(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="does not exist"):
        check_writable(tmp_path / "file" / "trace.h5")  # parent is a file
    with pytest.raises(ValueError, match="cannot write the timing dump to /proc/trace.h5"):
        check_writable("/proc/trace.h5")  # not writable even for root


@pytest.mark.mpi
@pytest.mark.parametrize("n,grid", [(4, (2, 2, 1)), (1, (1, 1, 1))])
def test_dump_gathers_all_ranks(tmp_path, n, grid):
    # n=1: the world is a LocalComm, which gathers this rank's bytes to itself
    path = tmp_path / "trace.h5"
    p = python_script(n, "trace_dump.py", path, *grid, timeout=90, check=True)
    assert f"trace_dump OK on {n} ranks" in p.stdout


@pytest.mark.mpi
def test_partial_dump_after_failure_is_readable(tmp_path):
    path = tmp_path / "trace.h5"
    p = python_script(3, "trace_partial.py", path, timeout=60)
    assert p.returncode != 0 and "deliberate failure in step 1 on rank 2" in p.stderr, p.stderr
    assert "unreachable" not in p.stdout
    from mpipar.analysis import load

    run = load(path)  # every rank's part: what it flushed before the failure
    assert run.complete is False and run.world_size == 3 and not run.notes
    for r, ev in enumerate(run.events):
        steps = set(ev["step"][ev["step"] >= 0].tolist())
        # the others may flush step 1 before failfast ends them: nothing waits for the failed one
        assert steps == {0} if r == 2 else steps >= {0}, (r, steps)
        assert "dp.allreduce" in set(ev["kind"][ev["step"] == 0])
    assert sorted(os.listdir(tmp_path)) == ["trace.h5", "trace.parts"]


# ----- bounded tracing: flushes append only what is new, readers trust the committed rows ------

ATTRS2 = [{"dp": 0, "pp": 0, "tp": 0}, {"dp": 0, "pp": 1, "tp": 0}]
FILE2 = {"config": {"lr": 0.1}, "grid": {"dp": 1, "pp": 2, "tp": 1}, "world_size": 2}


def _metrics(steps):
    t = Tracer()
    for s in steps:
        t.add_metrics(step=s, loss=1.0 + s)
    return t.metrics()


def test_take_hands_out_and_forgets():
    t = Tracer()
    t.record("F", 0, 1)
    t.add_metrics(step=0, loss=1.0)
    ev, m = t.take()
    assert len(ev) == 1 and len(m) == 1
    assert len(t.events()) == 0 and len(t.metrics()) == 0
    t.record("B", 1, 2)
    assert list(t.take()[0]["kind"]) == [b"B"]


def test_flushes_append_and_the_reader_sees_every_row(tmp_path):
    from mpipar.analysis.dump import load

    path = tmp_path / "trace.h5"
    write_dump(path, [_events(3, 0), _events(1, 1)], ATTRS2, FILE2, metrics=_metrics([0]))
    for k in range(3):
        append_dump(path, [_events(2, 10 + k), _events(0, 20 + k)], ATTRS2,
                    dict(FILE2, complete=k == 2), metrics=_metrics([k + 1]))
    run = load(path)
    assert [len(e) for e in run.events] == [9, 1] and run.complete
    assert list(run.metrics["step"]) == [0, 1, 2, 3]
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["committed"]) == {"events": [9, 1], "metrics": 4}
        assert f["ranks/0/events"].maxshape == (None,)
    assert os.listdir(tmp_path) == ["trace.h5"]


def _events_of_step(n, step):
    ev = _events(n, step)
    ev["step"] = step
    return ev


def test_a_resumed_run_continues_the_dump_from_its_step(tmp_path):
    """Steps 0-4 flushed, a crash, a resume from the checkpoint of step 3: the rows of steps 3
    and 4 are dropped (the resumed run redoes them), the rest kept; appends follow them."""
    path = tmp_path / "trace.h5"
    write_dump(path, [_events_of_step(2, 0), _events_of_step(1, 0)], ATTRS2, FILE2,
               metrics=_metrics([0]))
    for k in range(1, 5):
        append_dump(path, [_events_of_step(2, k), _events_of_step(1, k)], ATTRS2, FILE2,
                    metrics=_metrics([k]))
    assert not rewind_dump(path, 3, 3)  # another world size: the dump is not continued
    assert not rewind_dump(tmp_path / "none.h5", 3, 2)
    assert rewind_dump(path, 3, 2)
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["committed"]) == {"events": [6, 3], "metrics": 3}
        assert not f.attrs["complete"]
    for k in range(3, 6):
        append_dump(path, [_events_of_step(2, k), _events_of_step(1, k)], ATTRS2,
                    dict(FILE2, complete=k == 5), metrics=_metrics([k]))
    from mpipar.analysis.dump import load

    run = load(path)
    assert list(run.metrics["step"]) == [0, 1, 2, 3, 4, 5] and run.complete
    assert list(run.events[0]["step"]) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_a_reader_during_the_run_does_not_block_a_flush(tmp_path):
    path = tmp_path / "trace.h5"
    write_dump(path, [_events(3, 0), _events(1, 1)], ATTRS2, FILE2)
    import subprocess
    import sys

    # another process (`mpipar analyze` while the run goes on) holds the file open for reading
    reader = subprocess.Popen([sys.executable, "-c", "import h5py, sys, time\n"
                               f"f = h5py.File({str(path)!r}, 'r')\nprint('open', flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "open"
        append_dump(path, [_events(2, 1), _events(2, 2)], ATTRS2, FILE2)
    finally:
        reader.kill()
        reader.wait()
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["committed"])["events"] == [5, 3]


def test_a_crash_mid_flush_leaves_the_committed_rows(tmp_path, monkeypatch):
    """Rows written but not committed (the flush died before the count was updated) are
    ignored by the reader and written over by the next flush."""
    from mpipar import trace
    from mpipar.analysis.dump import load

    path = tmp_path / "trace.h5"
    write_dump(path, [_events(3, 0), _events(1, 1)], ATTRS2, FILE2, metrics=_metrics([0]))
    before = load(path)

    def die(*a, **k):
        raise OSError("killed mid-flush")

    monkeypatch.setattr(trace, "_committed", die)
    with pytest.raises(OSError, match="killed"):
        append_dump(path, [_events(5, 3), _events(5, 4)], ATTRS2, dict(FILE2, complete=True),
                    metrics=_metrics([1]))
    with h5py.File(path, "r") as f:
        assert f["ranks/0/events"].shape == (8,)  # the rows reached the file ...
    after = load(path)  # ... but are not committed
    assert [len(e) for e in after.events] == [3, 1] and not after.complete
    assert np.array_equal(after.events[0], before.events[0]) and len(after.metrics) == 1
    monkeypatch.undo()
    append_dump(path, [_events(1, 5), _events(0, 6)], ATTRS2, FILE2, metrics=None)
    assert [len(e) for e in load(path).events] == [4, 1]


def test_dumps_written_before_the_committed_count_are_read_whole(tmp_path):
    """Backward compatibility: a schema-1 dump from before appending (fixed-size datasets, no
    ``committed``) reads as before."""
    from mpipar.analysis.dump import load

    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:
        f.attrs["schema_version"] = 1
        for k, v in FILE2.items():
            f.attrs[k] = json.dumps(v) if isinstance(v, dict) else v
        for r in range(2):
            g = f.create_group(f"ranks/{r}")
            g.create_dataset("events", data=_events(3, r))
            for k, v in ATTRS2[r].items():
                g.attrs[k] = v
    run = load(path)
    assert [len(e) for e in run.events] == [3, 3] and run.metrics is None


def test_a_bit_flipped_dump_names_the_file(tmp_path):
    from mpipar.analysis.dump import DumpError, load

    path = tmp_path / "trace.h5"
    write_dump(path, [_events(3, 0), _events(1, 1)], ATTRS2, FILE2)
    with h5py.File(path, "r") as f:
        offset = f["ranks/0/events"].id.get_chunk_info(0).byte_offset  # chunked
    raw = bytearray(path.read_bytes())
    raw[offset] = 0xFF  # the first byte of a `kind`: no longer UTF-8
    path.write_bytes(bytes(raw))
    with pytest.raises(DumpError, match=r"trace\.h5: damaged timing dump.*UnicodeDecodeError"):
        load(path)
    raw = bytearray(path.read_bytes())
    for i in range(64, len(raw), 97):  # many flipped bits anywhere
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(DumpError, match=r"trace\.h5: "):
        load(path)


def test_memory_stays_bounded_over_flushes(tmp_path):
    """The tracer holds only what came since the last flush, whatever the number of flushes."""
    path = tmp_path / "trace.h5"
    t = Tracer()
    held = []
    for flush in range(5):
        for i in range(200):
            t.record("F", i, i + 1)
        ev, m = t.take()
        (append_dump if flush else write_dump)(path, [ev], [{"dp": 0, "pp": 0, "tp": 0}],
                                               {"world_size": 1})
        held.append(len(t._events))
    assert held == [0] * 5
    with h5py.File(path, "r") as f:
        assert f["ranks/0/events"].shape == (1000,)


@pytest.mark.mpi
def test_soak_script_prints_rss_per_rank(tmp_path):
    import subprocess
    import sys

    from mpi_util import ONE_THREAD, REPO

    res = subprocess.run([sys.executable, str(REPO / "experiments" / "soak.py"), "--steps", "100",
                          "--every", "50", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **ONE_THREAD}, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "2 ranks: r1 MiB" in res.stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["step"] for r in rows] == [50, 100]
    assert all(r["2 ranks: r1 MiB"] > 0 for r in rows)


_APPENDER = """
import sys
import numpy as np
from mpipar.trace import EVENT_DTYPE, append_dump, write_dump
path = sys.argv[1]
attrs = [{"dp": 0, "pp": 0, "tp": 0}, {"dp": 0, "pp": 1, "tp": 0}]
fa = {"config": {}, "grid": {"dp": 1, "pp": 2, "tp": 1}, "world_size": 2}
ev = np.zeros(500, dtype=EVENT_DTYPE)
ev["kind"] = b"F"
write_dump(path, [ev, ev], attrs, fa)
print("ready", flush=True)
while True:
    append_dump(path, [ev, ev], attrs, fa)
"""


def test_sigkill_during_flushes_leaves_a_readable_dump(tmp_path):
    """A writer appending without pause is killed at a random moment, 8 times: each dump reads,
    both ranks with the same whole number of flushes (no torn or half-committed flush)."""
    import random
    import subprocess
    import sys
    import time

    from mpipar.analysis.dump import load

    rng = random.Random(14)
    for i in range(8):
        path = tmp_path / f"t{i}.h5"
        p = subprocess.Popen([sys.executable, "-c", _APPENDER, str(path)],
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            p.kill()
            p.wait()
        lens = [len(e) for e in load(path).events]
        assert lens[0] == lens[1] and lens[0] % 500 == 0 and lens[0] >= 500, lens
