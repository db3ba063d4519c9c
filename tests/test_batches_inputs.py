"""Batches.get(inputs=False): a pipeline rank without the first chunk gathers no inputs, and
draws the same rows (the same targets) as every other rank."""

import numpy as np
import pytest

from mpipar.config import load_config
from mpipar.training.batches import Batches


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("parts, part", [(1, 0), (2, 1)])
def test_targets_and_shape_without_inputs(task, parts, part):
    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": "[12, 8, 3]",
                             "model.task": task, "train.dtype": "float32"})
    b = Batches(cfg)
    for split, step in (("train", 0), ("train", 7), ("val", 2)):
        x, y = b.get(split, step, 16, parts, part)
        x0, y0 = b.get(split, step, 16, parts, part, inputs=False)
        assert x0.shape == x.shape and x0.dtype == x.dtype
        assert y0.dtype == y.dtype and np.array_equal(y0, y)
        assert not x0.flags.writeable  # a view of one row: nobody may write into it
        assert x0.strides[0] == 0
