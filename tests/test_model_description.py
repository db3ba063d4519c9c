"""The model description (``mpipar.models.spec``) against what is built from it and what runs.

- per unit, the parameter counts of ``models.counts`` equal the arrays of a built model, full
  shapes and this rank's shards, for every tp mode (each rank's shards built without MPI: the
  contexts take stand-in communicators, and building sends nothing);
- the values a block keeps from forward to backward (``UnitCounts.stored``) equal the saved
  contexts of a real block on 2D and 3D ranks (shape-true stand-in collectives), as
  tests/test_memory_model.py checks 1D;
- ``stage_bounds`` cuts as the layout says, and as the trainer weighed units from a built model;
- FLOPs and parameter totals equal the closed forms the planner and analysis quote;
- the memory model's prediction of a ``--layout`` run and of a 2D run is within 15 % of the
  trainer's measured peak (mpiexec, as tests/test_memory_model.py's two-rank row).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi_util import python_script
from saved_context import ctx_arrays

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.models import GPTDims, build_model, gpt_block, gpt_counts, param_count, stage_bounds
from mpipar.models.counts import block_counts, forward_flops_per_token, matmul_params
from mpipar.nn.layers import ParamFactory
from mpipar.parallel.pipeline.partition import chunk_layers
from mpipar.parallel.tensor import TPContext
from mpipar.parallel.tensor_nd import TP2DContext, TP3DContext
from mpipar.training.memory import distinct_bytes

REPO = Path(__file__).resolve().parent.parent
BK = Backend("cpu", "float64")


class ShapeComm:
    """A communicator of ``size`` ranks seen from rank ``rank``, right in shapes only."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def allreduce(self, x, op="sum", inplace=False):
        return x if inplace else x.copy()

    def allreduce_scalar(self, x, op="sum"):
        return x

    def allgather(self, x, axis=0):
        return np.concatenate([x] * self.size, axis=axis)

    def reduce_scatter(self, x, axis=0):
        n = x.shape[axis] // self.size
        return np.take(x, range(n), axis=axis).copy()

    def broadcast(self, buf, root=0):
        return buf


def contexts(coords):
    """The tp context of each mode on the rank at grid coordinates ``coords``."""
    i, j, k = coords
    return {
        "1d": TPContext(ShapeComm(4, j), 4, j),
        "1d-sp": TPContext(ShapeComm(4, j), 4, j, sequence_parallel=True),
        "2d": TP2DContext(ShapeComm(4, 2 * i + j), row=ShapeComm(2, j), col=ShapeComm(2, i), q=2),
        "2.5d": TP2DContext(ShapeComm(8, 4 * k + 2 * i + j), row=ShapeComm(2, j),
                            col=ShapeComm(2, i), q=2, dep=ShapeComm(2, k), mode="2.5d"),
        "3d": TP3DContext(ShapeComm(8, 4 * i + 2 * j + k), ci=ShapeComm(2, i),
                          cj=ShapeComm(2, j), cl=ShapeComm(2, k), q=2),
    }


MCFG = load_config(None, {"model.n_layer": "2", "model.n_embd": "16", "model.n_head": "4",
                          "model.vocab_size": "32", "model.block_size": "8",
                          "train.seq_len": "8"}).model


@pytest.mark.parametrize("coords", [(0, 0, 0), (1, 0, 1)])
@pytest.mark.parametrize("mode", ["1d", "1d-sp", "2d", "2.5d", "3d"])
def test_counts_are_the_arrays_of_the_built_model(mode, coords):
    tp = contexts(coords)[mode]
    model = build_model(MCFG, BK, seed=1, tp=tp)
    counts = gpt_counts(GPTDims.of(MCFG), tp.split)
    assert len(counts) == len(model.units)
    for unit, c in zip(model.units, counts, strict=True):
        params = unit.params()
        assert c.params_full == sum(int(np.prod(p.full_shape)) for p in params), unit
        assert c.params == sum(p.data.size for p in params), unit
    assert param_count(GPTDims.of(MCFG)) == model.n_params_full


def test_a_tied_head_counts_no_weight_of_its_own():
    mcfg = load_config(None, {"model.tie_embeddings": "true"}).model
    tp = TPContext(ShapeComm(2), 2, 0)
    model = build_model(mcfg, BK, tp=tp)
    counts = gpt_counts(GPTDims.of(mcfg), tp.split)
    assert counts[-1].params == sum(p.data.size for p in model.units[-1].params())
    assert param_count(GPTDims.of(mcfg)) == model.n_params_full




@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_block_stored_is_what_a_2d_or_3d_block_keeps(mode):
    b, s, d, heads = 8, 8, 16, 4
    tp = contexts((1, 0, 1))[mode]
    split = tp.split
    pf = ParamFactory(BK, seed=1, tp_rank=tp.rank, tp_size=tp.size)
    block = gpt_block(pf, tp, 0, d, heads)
    shape = (b // split.tokens("residual"), s, d // split.hidden("residual"))
    block.forward(np.random.default_rng(0).standard_normal(shape), 0)
    dims = GPTDims(n_layer=1, n_embd=d, n_head=heads, vocab_size=4, block_size=s)
    want = b * s * block_counts(dims, split, s).stored * 8
    assert distinct_bytes(ctx_arrays(block, [])) == want


def test_stage_bounds_honour_the_layout_and_weigh_units_as_the_built_model():
    cfg = load_config(None, {"model.n_layer": "4", "parallel.pp": "2",
                             "parallel.layout": "Et*3|tL"})
    assert stage_bounds(cfg.model, cfg.parallel, 2, 1) == {0: (0, 4), 1: (4, 6)}
    for tp in (1, 2):
        cfg = load_config(None, {"model.n_layer": "4", "model.vocab_size": "4096",
                                 "parallel.partition": "params"})
        model = build_model(cfg.model, BK, tp=TPContext(ShapeComm(tp), tp, 0))
        weights = [sum(int(np.prod(q.full_shape)) for q in u.params()) + 1 for u in model.units]
        for pp, v in ((2, 1), (3, 1), (2, 2)):
            assert stage_bounds(cfg.model, cfg.parallel, pp, v) == chunk_layers(
                len(model.units), pp, v, method="params", weights=weights)


def test_flops_and_totals_are_the_closed_forms():
    l, h, a, s, V = 3, 64, 4, 32, 100
    dims = GPTDims(n_layer=l, n_embd=h, n_head=a, vocab_size=V, block_size=s,
                   tie_embeddings=True)
    assert forward_flops_per_token(dims, s) == l * (24 * h * h + 4 * s * h) + 2 * h * V
    assert matmul_params(dims) == 12 * l * h * h + V * h
    assert param_count(dims) == l * (12 * h * h + 13 * h) + V * h + s * h + 2 * h


def _predicted_vs_measured(tmp_path, ranks, sets):
    from mpipar.analysis import load
    from mpipar.analysis.memory_model import predict_run
    from mpipar.analysis.predict import measured_memory

    args = ["--config", REPO / "experiments" / "configs" / "exp_bubble.toml", "--out", tmp_path,
            "--steps", "3"]
    gpt = {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 4, "model.block_size": 128,
           "train.batch_size": 32, "train.seq_len": 128, "parallel.microbatches": 2,
           "parallel.partition": "uniform"}
    for k, v in {**gpt, **sets}.items():
        args += ["--set", f"{k}={v}"]
    python_script(ranks, REPO / "experiments" / "memory_driver.py", *args, timeout=400,
                  check=True)
    run = load(tmp_path / "trace.h5")
    stage = np.array([int(c[1]) for c in run.coords])
    measured = np.asarray(measured_memory(run))
    predicted = predict_run(run.config, run.grid)
    return [(p["total"], float(measured[stage == k].mean())) for k, p in enumerate(predicted)]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("ranks, sets", [
    (2, {"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.layout": "Et*3|tL"}),
    (4, {"parallel.tp": 4, "parallel.tp_mode": "2d", "parallel.schedule": "gpipe"}),
], ids=["layout", "2d"])
def test_memory_model_meets_the_measured_peak(tmp_path, ranks, sets):
    """Before the memory model read the description, these rows were -32 / +38 % (layout) and
    +52 % (2d) off; within 15 % is the bar every row of experiments/memory_peak.py meets."""
    rows = _predicted_vs_measured(tmp_path, ranks, sets)
    assert len(rows) == sets.get("parallel.pp", 1)
    for predicted, measured in rows:
        assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)

