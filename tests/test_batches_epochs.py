"""An MLP's rows are read epoch by epoch: each epoch a permutation of the split's rows, a step's
rows the next ``batch`` positions of the epochs laid end to end, a function of (seed, step)."""

import numpy as np
import pytest

from mpipar.config import load_config
from mpipar.training.batches import Batches


def batches(seed=3):
    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": "[12, 8, 3]",
                             "model.task": "classification", "train.seed": str(seed)})
    return Batches(cfg)


@pytest.mark.parametrize("split, batch", [("train", 128), ("train", 100), ("val", 128),
                                          ("val", 1000)])
def test_every_row_once_per_epoch(split, batch):
    b = batches()
    n = len(b.split[split][0])
    steps = -(-3 * n // batch)  # three epochs and a bit
    stream = np.concatenate([b.rows(split, s, batch) for s in range(steps)])
    for e in range(3):
        epoch = stream[e * n:(e + 1) * n]
        assert np.array_equal(np.sort(epoch), np.arange(n))  # each row exactly once
    assert not np.array_equal(stream[:n], stream[n:2 * n])  # a new order every epoch


def test_a_step_depends_on_seed_and_step_alone():
    a, b = batches(), batches()
    asked = [(split, s) for split in ("train", "val") for s in (57, 3, 0, 29, 28)]
    first = {k: a.rows(*k, 128) for k in asked}
    for k in reversed(asked):  # any order of asking: a resume at step s draws what a run drew
        assert np.array_equal(b.rows(*k, 128), first[k])
        assert np.array_equal(b.get(*k, 128)[1], a.get(*k, 128)[1])
    fresh = batches()
    assert np.array_equal(fresh.rows("train", 29, 128), a.rows("train", 29, 128))
    assert not np.array_equal(batches(seed=4).rows("train", 0, 128), a.rows("train", 0, 128))


def test_parts_are_the_global_batch_rows():
    b = batches()
    x, y = b.get("train", 31, 128)
    for part in range(4):
        xp, yp = b.get("train", 31, 128, 4, part)
        assert np.array_equal(xp, x[part * 32:(part + 1) * 32])
        assert np.array_equal(yp, y[part * 32:(part + 1) * 32])


def test_the_order_cannot_be_written():
    b = batches()
    rows = b.rows("train", 0, 16)
    with pytest.raises(ValueError):
        rows[0] = 1
