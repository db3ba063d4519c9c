"""The memory model against what the code really holds.

- ``block_stored``: the bytes a real GPT block keeps in its layers' saved contexts after a
  forward (tp = 1, selective recomputation, tp = 2 with and without sequence parallelism, the
  collectives replaced by shape-true stand-ins): exact, the formula is a count of those arrays.
- ``predict_run`` against one-rank training steps under tracemalloc (NumPy reports its buffers
  to it): the state counted exactly plus the NumPy-tracked peak the steps add above set-up.
  Tolerance 10 %: the model meets 5 % on every row of experiments/README.md section 2b
  (NumPy-tracked column) and on these (within 5 % here too); the rest is room, since the pool's
  per-shape high-water marks and the working set are counted per kind of buffer, not simulated
  allocation by allocation.
- a real two-rank pipeline (mpiexec, ``experiments/memory_peak.py --quick``): the trainer's own
  ``mem.*`` record against the prediction within 15 % (the issue's target; this row is at -5 and
  -7 %: the resident peak also holds 2-6 MiB outside NumPy that the model leaves out), and the
  NumPy-tracked peak within 10 % as above.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from saved_context import ctx_arrays

from mpipar.analysis.memory_model import block_stored, predict_run
from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.models import gpt_block
from mpipar.nn import cpu
from mpipar.nn.layers import ParamFactory, set_selective_recompute
from mpipar.parallel.tensor import TPContext
from mpipar.training.memory import distinct_bytes

REPO = Path(__file__).resolve().parent.parent


class ShapeComm:
    """A tp communicator of ``size`` ranks seen from rank 0, right in shapes only: what the
    saved contexts hold does not depend on the values the other ranks send."""

    def __init__(self, size):
        self.size, self.rank = size, 0

    def allreduce(self, x, op="sum", inplace=False):
        return x if inplace else x.copy()

    def allgather(self, x, axis=0):
        return np.concatenate([x] * self.size, axis=axis)

    def reduce_scatter(self, x, axis=0):
        n = x.shape[axis] // self.size
        return np.take(x, range(n), axis=axis).copy()




@pytest.mark.parametrize("tp,sp,selective", [(1, False, False), (1, False, True),
                                             (2, False, False), (2, True, False)])
def test_block_stored_is_what_a_block_keeps(tp, sp, selective):
    b, s, d, heads = 2, 16, 32, 4
    comm = ShapeComm(tp) if tp > 1 else None
    ctx = TPContext(comm=comm, size=tp, rank=0, sequence_parallel=sp) if comm else TPContext()
    pf = ParamFactory(Backend("cpu", "float32"), seed=1, tp_rank=0, tp_size=tp)
    block = gpt_block(pf, ctx, 0, d, heads)
    if selective:
        set_selective_recompute([block])
    x = np.random.default_rng(0).standard_normal((b, s // tp if sp else s, d)).astype(np.float32)
    block.forward(x, 0)
    held = distinct_bytes(ctx_arrays(block, []))
    want = b * s * block_stored(d, heads, s, tp, sp) * 4
    if selective:
        want -= b * s * heads * s * 4 / tp
    assert held == want


def _traced_peak(sets: dict) -> tuple[float, list[dict]]:
    """One rank, three steps: mem.static + NumPy-tracked peak above set-up; and the model's."""
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer, preflight
    from mpipar.training.memory import state_arrays

    cfg = load_config(None, {"train.steps": "3", "train.eval_interval": "0",
                             "run.trace": "false", **sets})
    schedule = preflight(cfg, 1)
    backend = Backend("cpu", cfg.train.dtype)
    tracer = Tracer(enabled=False, backend=backend, rank=0)
    grid = ProcessGrid(1, 1, 1, tracer=tracer, backend=backend)
    data = None
    if cfg.model.kind == "gpt":
        from mpipar.training import prepare_data

        data = prepare_data(cfg, grid)
    gc.collect()
    cpu.clear_pool()  # buffers an earlier test left in the pool would be reused, not traced
    tracemalloc.start()
    try:
        trainer = Trainer(cfg, grid, tracer, backend, data, resolved=schedule)
        setup = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(3):
            trainer.train_step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    static = distinct_bytes(state_arrays(trainer))
    config = json.loads(json.dumps(cfg.to_dict()))
    return static + peak - setup, predict_run(config, {"dp": 1, "pp": 1, "tp": 1})


@pytest.mark.parametrize("sets", [
    {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.block_size": "64",
     "model.vocab_size": "256", "train.seq_len": "64", "train.batch_size": "16",
     "parallel.microbatches": "2", "parallel.schedule": "gpipe"},
    {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.block_size": "64",
     "model.vocab_size": "256", "train.seq_len": "64", "train.batch_size": "16",
     "parallel.recompute": "selective"},
    {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.block_size": "64",
     "model.vocab_size": "256", "train.seq_len": "64", "train.batch_size": "16",
     "parallel.recompute": "full", "parallel.microbatches": "2"},
    {"model.kind": "mlp", "model.sizes": "[256, 512, 512, 10]", "train.batch_size": "128",
     "parallel.microbatches": "2"},
], ids=["gpt-gpipe-m2", "gpt-selective", "gpt-full", "mlp"])
def test_predicted_peak_meets_numpy_tracked_peak_on_one_rank(sets):
    measured, predicted = _traced_peak(sets)
    assert predicted is not None and len(predicted) == 1
    assert abs(predicted[0]["total"] - measured) <= 0.10 * measured, (predicted[0], measured)


def test_predicted_peak_meets_the_trainers_record_on_two_ranks(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "memory_peak.py"),
                           "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["pp_rank"] for r in rows] == [0, 1]
    for r in rows:
        assert abs(r["error_pct"]) <= 15, r
        assert abs(r["traced_error_pct"]) <= 10, r


def test_planner_counts_each_ranks_own_live_micro_batches():
    """The planner (mpipar/plan) checks its first and last ranks; both hold the simulator's
    peak of live micro-batches, as the memory model here takes them (the last rank was taken
    as holding one whatever the schedule)."""
    from mpipar.plan.pipeline import in_flight, in_flight_last, run_simulation

    for kind, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("zb-h1", (1,)), ("interleaved", (2, 3))):
        for p in (2, 3, 4, 6):
            for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p}):
                for v in vs:
                    if kind == "interleaved" and m % p:
                        continue
                    for f, b, w in ((1, 1, 1), (1, 2, 0.5), (1, 0.5, 1.2)):
                        costs = ({"F": f, "B": b, "W": w} if kind == "zb-h1"
                                 else {"F": f, "BW": b + w})
                        peaks = run_simulation(kind, p, m, v, costs).peak_activations
                        assert in_flight(kind, p, m, v) * v == peaks[0]
                        assert in_flight_last(kind, p, m, v) * v == peaks[-1], (kind, p, m, v)


def test_dp_scratch_counts_the_peer_blocks_of_registered_buckets(monkeypatch):
    """Where the tuning picks shared memory for a registered bucket (ZeRO-1's reduce-scatter or
    the all-reduce of a large bucket on one node), nothing is copied: the scratch is this rank's
    block of every other rank's bucket, mapped here; where it picks exchanging halves, that
    algorithm's power-of-two scratch."""
    from mpipar.analysis.memory_model import _pow2, dp_scratch
    from mpipar.mpi import tuning

    monkeypatch.setattr(tuning, "_TABLE", {})  # the built-in defaults, whatever ~/.cache holds
    n = 16 << 20  # one 16 MiB float32 bucket
    assert tuning.choose("reduce_scatter_registered", n, 2) == "shm"
    assert dp_scratch([n // 4], 2, True, 4, 25.0) == n // 2  # the other rank's half
    assert dp_scratch([n // 4, n // 4], 2, True, 4, 25.0) == n  # two chunks' buckets: both
    assert dp_scratch([n // 4], 4, False, 4, 25.0) == 3 * n // 4
    monkeypatch.setattr(tuning, "_TABLE", {"allreduce_registered": {2: [(n, "rabenseifner")]}})
    assert dp_scratch([n // 4], 2, False, 4, 25.0) == _pow2(n)


@pytest.mark.parametrize("dense", [True, False])
def test_mlp_stored_is_what_its_layers_keep(dense):
    """A ReLU keeps its output (the next linear's input), in the fast path and the layers' own:
    the memory model counts each hidden layer's input once, the head's input and its output
    (which the loss keeps as its softmax, not counted here)."""
    from mpipar.analysis.memory_model import _units_mlp
    from mpipar.models import build_model

    sizes, b = [24, 40, 36, 10], 6
    cfg = load_config(None, {"model.kind": "mlp", "model.sizes": str(sizes),
                             "model.activation": "relu"})
    model = build_model(cfg.model, Backend("cpu", "float32"))
    x = np.random.default_rng(0).standard_normal((b, sizes[0])).astype(np.float32)
    for unit in model.units:
        unit.set_dense(dense)
        x = unit.forward(x, 0)
    held = distinct_bytes([a for u in model.units for a in ctx_arrays(u, [])])
    units, _ = _units_mlp({"sizes": sizes, "activation": "relu"}, b)
    assert held == (sum(u[1] for u in units) - b * sizes[-1]) * 4
