"""A flushing step's one world reduction: the loss, the gradient norm (only when clipping needs
it) and the stop agreement travel together."""

import math
import signal

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.nn.optim import LocalGradNorm, grad_norm_sq_local
from mpipar.trace import Tracer
from mpipar.training import Trainer
from mpipar.training.signals import StopSignals


def _trainer(clip):
    cfg = load_config(None, {
        "model.kind": "mlp", "model.sizes": "[12, 16, 16, 5]", "model.activation": "relu",
        "model.task": "classification", "train.dtype": "float64", "train.steps": 4,
        "train.batch_size": 8, "train.warmup_steps": 0, "train.grad_clip": clip,
        "train.eval_interval": 0, "parallel.microbatches": 2, "run.trace": False})
    b = Backend("cpu", "float64")
    return Trainer(cfg, ProcessGrid(1, 1, 1, backend=b), Tracer(enabled=False), b, None)


def test_without_clipping_the_norm_is_not_computed_and_the_steps_are_the_same(monkeypatch):
    clipped_never = _trainer(1e9)  # a bound no gradient reaches: the same updates as no clip
    want = [clipped_never.train_step() for _ in range(3)]
    assert all(math.isfinite(r["grad_norm"]) for r in want)
    # the norm of the first step is the gradients' own
    fresh = _trainer(1e9)
    fresh.forward_backward()
    assert want[0]["grad_norm"] == math.sqrt(grad_norm_sq_local(fresh.params))

    def refuse(self):
        raise AssertionError("the gradient norm was computed without clipping")

    monkeypatch.setattr(LocalGradNorm, "__call__", refuse)
    plain = _trainer(0)
    got = [plain.train_step() for _ in range(3)]
    assert all(math.isnan(r["grad_norm"]) for r in got)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert all(np.array_equal(p.data, q.data)
               for p, q in zip(plain.params, clipped_never.params))


@pytest.mark.parametrize("clip", [0, 1.0])
def test_the_stop_agreement_rides_on_the_step_reduction(clip):
    tr = _trainer(clip)
    assert tr.take_stop() is None  # no step yet: the loop agrees on its own
    with StopSignals() as sig:
        tr.stop_signals = sig
        tr.train_step()
        assert tr.take_stop() == 0
        assert tr.take_stop() is None  # read once
        sig.received = int(signal.SIGUSR1)
        tr.train_step()
        assert tr.take_stop() == int(signal.SIGUSR1) and sig.stopping
