"""A flushing step's optimizer zeroes each block of gradients right after the update reads it,
and the next step then skips its own zeroing pass (``Step._zeroing``): the same updates, bit
for bit, as a step that zeroes at its start; under ZeRO-1 (slices in the optimizer) the step
zeroes at its start as before."""

import numpy as np
import pytest

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.nn import optim
from mpipar.trace import Tracer
from mpipar.training import Trainer


def _trainer(opt, momentum=0.0, schedule="1f1b"):
    cfg = load_config(None, {
        "model.kind": "mlp", "model.sizes": "[12, 16, 16, 5]", "model.activation": "relu",
        "model.task": "classification", "train.dtype": "float64", "train.steps": 6,
        "train.batch_size": 8, "train.warmup_steps": 0, "train.optimizer": opt,
        "train.momentum": momentum, "train.weight_decay": 0.01, "train.eval_interval": 0,
        "parallel.microbatches": 2, "parallel.schedule": schedule, "run.trace": False})
    b = Backend("cpu", "float64")
    return Trainer(cfg, ProcessGrid(1, 1, 1, backend=b), Tracer(enabled=False), b, None)


@pytest.mark.parametrize("opt, momentum, schedule", [("sgd", 0.0, "1f1b"), ("sgd", 0.9, "gpipe"),
                                                     ("adamw", 0.0, "1f1b")])
def test_zeroing_in_the_update_gives_the_steps_of_zeroing_at_the_start(opt, momentum, schedule,
                                                                        monkeypatch):
    monkeypatch.setattr(optim, "OPT_BLOCK_ELEMENTS", 64)  # blocks cut through the tensors
    monkeypatch.setattr(optim, "SGD_ONE_BLOCK_ELEMENTS", 64)
    fused, plain = _trainer(opt, momentum, schedule), _trainer(opt, momentum, schedule)
    plain.mode._zeroes_all = False  # the gradients zeroed as each step starts
    assert fused.mode._zeroing()
    for _ in range(4):
        a, b = fused.train_step(), plain.train_step()
        assert a["loss"] == b["loss"]
        assert all(not p.grad.any() for p in fused.params)  # zeroed by the update
        assert any(p.grad.any() for p in plain.params)  # left until the next step starts
        assert all(np.array_equal(p.data, q.data) for p, q in zip(fused.params, plain.params))
    # forward_backward after an update reads this step's gradients alone, as before
    fused.forward_backward(), plain.forward_backward()
    assert all(np.array_equal(p.grad, q.grad) for p, q in zip(fused.params, plain.params))


def test_a_gradient_written_outside_a_step_is_zeroed_by_the_next_one():
    """Only the update's own zeroing is trusted: gradients left by a forward_backward with no
    update are zeroed as the next step starts."""
    tr, ref = _trainer("sgd"), _trainer("sgd")
    tr.train_step(), ref.train_step()
    tr.forward_backward()  # no update: the gradients stay
    want, got = ref.train_step(), tr.train_step()
    assert got["loss"] == want["loss"]
    assert all(np.array_equal(p.data, q.data) for p, q in zip(tr.params, ref.params))


def test_a_strided_gradient_leaves_the_zeroing_to_the_step_start():
    """A gradient that is a strided view may reach the optimizer as a copy: no zeroing there."""
    tr = _trainer("sgd")
    p = next(q for q in tr.params if q.grad.ndim == 2)
    p.grad = np.zeros(p.grad.shape[::-1]).T  # the same shape, not contiguous
    tr.mode._zeroes_all = None
    assert not tr.mode._zeroing()


def test_zero1_slices_leave_the_zeroing_to_the_step_start():
    tr = _trainer("sgd")
    tr.sync.zero1 = True  # what the check reads; its optimizer would hold the slices
    tr.mode._zeroes_all = None
    assert not tr.mode._zeroing()
