"""A pipeline rank reads the next step's batch at its first wait of a step (``Step._prefetch``,
run by ``Receives`` before the first receive whose message is late): when it runs, that the
step after uses what it read, and the memory model's count of it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mpipar.analysis.memory_model import predict_run, prefetch_bytes
from mpipar.parallel.pipeline.actions import Action
from mpipar.parallel.pipeline.transfers import Receives, RecvPool, receive_plan
from mpipar.trace import Tracer
from mpipar.training.steps import Step


class _Request:
    def __init__(self, arrived, buf):
        self.arrived, self.buf, self.tests = arrived, buf, 0

    def test(self):
        self.tests += 1
        return self.arrived

    def wait(self):
        return self.buf


class _Comm:
    """Receives whose messages are already there (True) or late (False), in posting order."""

    def __init__(self, arrived):
        self.arrived, self.posted = list(arrived), []

    def irecv(self, shape, dtype, peer, tag, *, mb, chunk, xp, out):
        self.posted.append(_Request(self.arrived.pop(0), out))
        return self.posted[-1]


def _receives(arrived):
    actions = [Action("RECV_B", mb, 0) for mb in range(len(arrived))]
    routes = {("RECV_B", 0): (1, (2, 3), 1)}
    comm = _Comm(arrived)
    return actions, comm, Receives(comm, receive_plan(actions), routes, np.float32, np,
                                   pool=RecvPool())


@pytest.mark.parametrize("arrived, at", [
    ([True, False, False, True], 1),  # the first late message runs it, and only that one
    ([False, False], 0),
    ([True, True, True], None),  # none late: not run
])
def test_idle_work_runs_once_before_the_first_late_message(arrived, at):
    actions, comm, rec = _receives(arrived)
    calls = []
    rec.idle = lambda: calls.append(len([r for r in comm.posted if r.tests]))
    for i, a in enumerate(actions):
        assert rec.take(a).shape == (2, 3)
        assert len(calls) == (0 if at is None or i < at else 1)
    if at is not None:
        assert calls == [at + 1]  # after testing the late one, before waiting for it
    assert rec.idle is None if at is not None else rec.idle is not None
    # once it ran, the later receives are not tested any more
    assert all(r.tests == (1 if at is None or i <= at else 0) for i, r in enumerate(comm.posted))


def test_no_idle_work_tests_nothing():
    actions, comm, rec = _receives([False, True])
    for a in actions:
        rec.take(a)
    assert [r.tests for r in comm.posted] == [0, 0]


def _step(steps=5):
    reads = []

    def local_batch(split, step):
        reads.append((split, step))
        return (f"x{step}", f"y{step}")

    t = SimpleNamespace(step=0, cfg=SimpleNamespace(train=SimpleNamespace(steps=steps)),
                        local_batch=local_batch, tracer=Tracer(enabled=True))
    return Step(t), t, reads


def test_the_prefetched_batch_is_the_next_steps_and_is_read_once():
    s, t, reads = _step()
    assert s._local_batch(0) == ("x0", "y0")
    s._prefetch()  # during step 0: reads step 1's
    assert reads == [("train", 0), ("train", 1)]
    t.step = 1
    assert s._local_batch(1) == ("x1", "y1") and reads[-1] == ("train", 1) and len(reads) == 2
    assert s._prefetched is None
    kinds = [e[0] for e in t.tracer._events]
    assert kinds == ["DATA"]  # the read is an event of the timing dump


def test_a_prefetched_batch_of_another_step_is_dropped():
    s, t, reads = _step()
    s._prefetch()  # step 1's, but the run goes on at step 3 (a resume, say)
    assert s._local_batch(3) == ("x3", "y3") and s._prefetched is None
    assert reads == [("train", 1), ("train", 3)]


def test_the_last_step_reads_nothing_ahead():
    s, t, reads = _step(steps=2)
    t.step = 1
    s._prefetch()
    assert reads == [] and s._prefetched is None


def _mlp(pp_schedule="1f1b", continuous=False, steps=10):
    return {"model": {"kind": "mlp", "sizes": [784, 128, 64, 10], "task": "classification"},
            "train": {"batch_size": 128, "dtype": "float32", "steps": steps},
            "parallel": {"schedule": pp_schedule, "microbatches": 4, "continuous": continuous}}


def test_the_memory_model_counts_the_next_batch_where_it_is_read():
    grid = {"dp": 1, "pp": 2, "tp": 1}
    rows = predict_run(_mlp(), grid)
    # the first stage: inputs (128 x 784 float32) and int64 targets; the last: targets only
    assert [r["prefetch"] for r in rows] == [128 * 784 * 4 + 128 * 8, 128 * 8]
    assert all(r["total"] == sum(v for k, v in r.items() if k != "total") for r in rows)
    # dp = 2: each replica reads half the rows
    assert prefetch_bytes(_mlp(), {"dp": 2, "pp": 2, "tp": 1}, 2, True) == 64 * (784 * 4 + 8)
    gpt = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 64, "n_layer": 2,
                     "n_embd": 64, "n_head": 4},
           "train": {"batch_size": 16, "seq_len": 64, "dtype": "float32", "steps": 10},
           "parallel": {"schedule": "1f1b", "microbatches": 4}}
    assert prefetch_bytes(gpt, grid, 2, False) == 2 * 16 * 64 * 8  # token ids in and out


@pytest.mark.parametrize("config, pp", [(_mlp(), 1), (_mlp(continuous=True), 2),
                                        (_mlp(steps=1), 2)])
def test_no_next_batch_without_a_pipeline_a_flush_or_a_next_step(config, pp):
    assert prefetch_bytes(config, {"dp": 1, "pp": pp, "tp": 1}, pp, True) == 0
    assert all("prefetch" not in r for r in predict_run(config, {"dp": 1, "pp": pp, "tp": 1}))
