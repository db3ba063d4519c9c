"""Run under mpiexec -n 4 (tp_mode 2d, q = 2): one training step's 2D collectives against the
Optimus / SUMMA formulas, layer by layer, and per-rank memory against the one-rank model.

SUMMA (Optimus, arXiv 2104.05343, Alg. 1-3) for a linear with input block X (T x d_in/q, T = b s /
q tokens) and weight block W (d_in/q x d_out/q): forward C = AB broadcasts q blocks of X along
the row and q of W along the column; the backward's dX = dY W^T broadcasts q blocks of W along
the column and reduces q blocks of X's size along the row; dW = X^T dY broadcasts q blocks of X
along the row and reduces q blocks of W's size along the column. Here the q reductions of one
step block each are one reduce-scatter of the q stacked blocks (recorded with its whole input:
the same bytes). A bias adds an all-reduce of d_out/q over the column; LayerNorm all-reduces its
two moments (2 x T) forward and its two means (2T) backward over the row and its two weight
gradients (2 d/q) over the column; the embedding reduce-scatters (b, s, d/q) and all-gathers
the gradient block over the column; the loss all-reduces 3 x T over the row and one scalar over
the column.
usage: tp2d_count.py DATA.h5 L
"""

import sys
from collections import Counter
from pathlib import Path

from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.mpi.grid import ProcessGrid
from mpipar.trace import Tracer
from mpipar.training import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from memory_driver import _layer_arrays, held_bytes  # noqa: E402

data, L = sys.argv[1], int(sys.argv[2])
b, s, h, V, q, f = 4, 8, 32, 256, 2, 8
world = MPI.COMM_WORLD


def make(tp, mode, comm):
    cfg = load_config(None, {
        "train.dtype": "float64", "train.batch_size": b, "train.seq_len": s, "parallel.tp": tp,
        "parallel.tp_mode": mode, "parallel.microbatches": 1, "data.path": data,
        "model.n_layer": L, "model.n_embd": h, "model.n_head": 4, "model.block_size": s,
        "model.vocab_size": V, "run.trace": True, "train.eval_interval": 0})
    backend = Backend("cpu", "float64")
    tracer = Tracer(enabled=True, backend=backend, rank=comm.Get_rank())
    grid = ProcessGrid(1, 1, tp, world=comm, tracer=tracer, backend=backend)
    return Trainer(cfg, grid, tracer, backend, data), tracer


def expected_2d() -> Counter:
    T = b // q * s
    c = Counter()

    def lin(din, dout, bias=True):
        x, w = T * din // q * f, din // q * dout // q * f
        c[("tp_row.broadcast", x)] += 2 * q
        c[("tp_col.broadcast", w)] += 2 * q
        c[("tp_row.reduce_scatter", q * x)] += 1
        c[("tp_col.reduce_scatter", q * w)] += 1
        if bias:
            c[("tp_col.allreduce", dout // q * f)] += 1

    def ln():
        c[("tp_row.allreduce", T * f)] += 2
        c[("tp_row.allreduce", 2 * T * f)] += 1
        c[("tp_col.allreduce", 2 * h // q * f)] += 1

    c[("tp_col.reduce_scatter", b * s * h // q * f)] += 1  # token embedding
    c[("tp_col.allgather", T * h // q * f)] += 1
    c[("tp_col.allreduce", s * h // q * f)] += 1  # positions
    for _ in range(L):
        ln(), lin(h, 3 * h), lin(h, h), ln(), lin(h, 4 * h), lin(4 * h, h)
    ln(), lin(h, V, bias=False)
    c[("tp_row.allreduce", T * f)] += 3  # loss: row max, target logit, sum of exponentials
    c[("tp_col.allreduce", f)] += 1  # loss: the batch blocks' means
    return c


def measure(tr, tracer):
    """(tp collectives of one forward/backward, parameter bytes, activation bytes held after
    the forward of one micro-batch)."""
    tracer.step = 0
    tr.forward_backward()
    ev = tracer.events()
    seen = Counter((k.decode() if isinstance(k, bytes) else str(k), int(n))
                   for k, n in zip(ev["kind"], ev["bytes"]) if str(k).find("tp") >= 0)
    x, _ = tr.batches.get("train", 0, b)
    x = tr.backend.xp.asarray(x)
    for u in tr.model.units:
        x = u.forward(x, mb=5)
    arrays = []
    for u in tr.model.units:
        _layer_arrays(u, arrays)
    act = held_bytes(arrays)
    for u in tr.model.units:
        u.drop(5)
    return seen, sum(p.data.nbytes for p in tr.params), act


tr, tracer = make(4, "2d", world)
seen, par, act = measure(tr, tracer)
want = expected_2d()
if seen != want:
    diff = {k: (seen.get(k, 0), want.get(k, 0)) for k in set(seen) | set(want)
            if seen.get(k, 0) != want.get(k, 0)}
    sys.exit(f"rank {world.Get_rank()}: 2D collectives differ from the SUMMA count "
             f"(seen, formula): {diff}")
tr1, tracer1 = make(4, "1d", world)
_, par1d, act1d = measure(tr1, tracer1)
if world.Get_rank() == 0:
    ref, _ = make(1, "1d", MPI.COMM_SELF)
    _, par_one, act_one = measure(ref, _)
    # matrices and tables are 1/q^2 exactly; the d-vectors (LayerNorm, biases, positions) are
    # cut by column only, 1/q: replicated over the q ranks of a column by design
    vec = sum(p.data.nbytes for p in tr.params if len(p.full_shape) == 1
              or p.name.endswith("qkv.bias") or p.name == "embed.pos.weight")
    ratio_p, ratio_a = par / par_one, act / act_one
    print(f"bytes per rank per step (2d): {sum(n * k for (_, n), k in seen.items())}")
    print(f"params per rank: 2d {par} 1d {par1d} one rank {par_one}: 2d/one {ratio_p:.4f} "
          f"(1/q^2 = {1 / q**2}), of which vectors cut by column only {vec}")
    print(f"activations per rank: 2d {act} 1d {act1d} one rank {act_one}: 2d/one "
          f"{ratio_a:.4f}, 1d/one {act1d / act_one:.4f}")
    bad = [n for n, r in (("params", ratio_p), ("activations", ratio_a))
           if abs(r * q * q - 1) > 0.05]
    if bad:
        sys.exit(f"{bad} per rank not within 5% of 1/q^2 of one rank's")
    print(f"ok L={L}: {len(seen)} kinds of 2D collective equal the SUMMA formulas")
