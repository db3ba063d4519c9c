"""Run under mpiexec -n TP: count the tensor-parallel collectives of one training step.

Megatron's arrangement (Shoeybi et al. 2019; Korthikanti et al. 2022): per transformer block two
all-reduces of b*s*h elements forward (after attention and after the MLP: g) and two backward
(f); with sequence parallelism each becomes a reduce-scatter plus an all-gather of the same
total bytes. Compares the tracer's events with that count for n_layer = L, plus the embedding,
the LM head and the vocab-parallel loss (3 all-reduces of b*s scalars: max, target logit, sum).
usage: tp_count.py DATA.h5 TP L SP(0/1)
"""

import sys
from collections import Counter

from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.trace import Tracer
from mpipar.training import Trainer

data, tp, L, sp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
b, s, h = 4, 8, 16
cfg = load_config(None, {
    "train.dtype": "float64", "train.batch_size": b, "train.seq_len": s, "parallel.tp": tp,
    "parallel.sequence_parallel": sp, "parallel.microbatches": 1, "data.path": data,
    "model.n_layer": L, "model.n_embd": h, "model.n_head": 4, "model.block_size": s,
    "run.trace": True, "train.eval_interval": 0})
backend = Backend("cpu", "float64")
tracer = Tracer(enabled=True, backend=backend, rank=MPI.COMM_WORLD.Get_rank())
grid = ProcessGrid(1, 1, tp, world=MPI.COMM_WORLD, tracer=tracer, backend=backend)
tr = Trainer(cfg, grid, tracer, backend, data)
tracer.step = 0
tr.forward_backward()
ev = tracer.events()
seen = Counter((k.decode() if isinstance(k, bytes) else k, int(n))
               for k, n in zip(ev["kind"], ev["bytes"]) if str(k).find("tp.") >= 0)
full = b * s * h * 8  # bytes of one (b, s, h) float64 activation
small = b * s * 8
if not sp:
    expected = Counter({("tp.allreduce", full): 4 * L + 2, ("tp.allreduce", small): 3})
else:
    # all-gather records its input shard, reduce-scatter its full input; plus one flat
    # all-reduce of the gradients SP leaves partial (LayerNorms, row-parallel biases, positions)
    partial = sum(p.size for p in tr.params if p.spec.partial_grad) * 8
    expected = Counter({("tp.allgather", full // tp): 4 * L + 2,
                        ("tp.reduce_scatter", full): 4 * L + 2,
                        ("tp.allreduce", small): 3, ("tp.allreduce", partial): 1})
if seen != expected:
    sys.exit(f"rank {grid.rank}: tp collectives {dict(seen)} != Megatron count {dict(expected)}")
if grid.rank == 0:
    print(f"ok tp={tp} L={L} sp={sp}: {dict(seen)}")
