"""Run under mpiexec: one training step's 2D / 2.5D / 3D collectives against each paper's
formulas, layer by layer, and per-rank memory against the one-rank model.

usage: tp_nd_count.py DATA.h5 L MODE   (2d: 4 ranks; 2.5d (d = 2), 3d: 8 ranks; q = 2)

2D, SUMMA (Optimus, arXiv 2104.05343, Alg. 1-3), for a linear with input block X (T x d_in/q, T
the rank's tokens) and weight block W (d_in/q x d_out/q): forward C = AB broadcasts q blocks of X
along the row and q of W along the column; the backward's dX = dY W^T broadcasts q blocks of W
along the column and reduces q blocks of X's size along the row; dW = X^T dY broadcasts q blocks
of X along the row and reduces q blocks of W's size along the column. Here the q reductions of
one block each are one reduce-scatter of the q stacked blocks (recorded with its whole input:
the same bytes). A bias adds an all-reduce of d_out/q over the column; LayerNorm all-reduces its
two moments (2 x T) forward and its two means (2T) backward over the row and its two weight
gradients (2 d/q) over the column; the embedding reduce-scatters (b, s, d/q) and all-gathers the
gradient block over the column; the loss all-reduces 3 x T over the row and one scalar over the
column.
2.5D (Tesseract, arXiv 2105.14500): the same within each of the d layers on its batch slab
(T = b s / (d q)), plus an all-reduce over depth of every weight and vector gradient (the
blocks are the same on every layer), of the whole embedding table block and of the loss scalar.
3D (arXiv 2105.14450), a linear of input parity (a, c): forward all-gathers x over c (T x
d_in/q) and the weight piece over i (d_in/q^2 x d_out/q), reduce-scatters the q T x d_out/q
product over a; backward all-gathers dy over a and the weight again over i, reduce-scatters
dx (q T x d_in/q) over c; the weight gradient all-gathers x over c again and reduce-scatters
d_in/q x d_out/q over i; a bias all-reduces d_out/q over i. LayerNorm: moments over l, weight
gradients over i and j; embedding: reduce-scatters over i then j, all-gathers back; the loss
reduces 3 x T over j and one scalar over i and over l.
"""

import sys
from collections import Counter
from pathlib import Path

from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.trace import Tracer
from mpipar.training import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from memory_driver import _layer_arrays, held_bytes  # noqa: E402

data, L, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b, s, h, V, q, f = 8, 8, 64, 256, 2, 8
d = 2 if MODE == "2.5d" else 1
world = MPI.COMM_WORLD


def make(tp, mode, comm):
    cfg = load_config(None, {"parallel.tp_depth": d if mode == "2.5d" else 1,
        "train.dtype": "float64", "train.batch_size": b, "train.seq_len": s, "parallel.tp": tp,
        "parallel.tp_mode": mode, "parallel.microbatches": 1, "data.path": data,
        "model.n_layer": L, "model.n_embd": h, "model.n_head": 4, "model.block_size": s,
        "model.vocab_size": V, "run.trace": True, "train.eval_interval": 0})
    backend = Backend("cpu", "float64")
    tracer = Tracer(enabled=True, backend=backend, rank=comm.Get_rank())
    grid = ProcessGrid(1, 1, tp, world=comm, tracer=tracer, backend=backend)
    return Trainer(cfg, grid, tracer, backend, data), tracer


def expected_2d() -> Counter:
    """2D (d = 1) and 2.5D (d layers, gradients also summed over depth)."""
    T = b // (d * q) * s
    c = Counter()

    def dep(n):
        if d > 1:
            c[("tp.dep.allreduce", n)] += 1

    def lin(din, dout, bias=True):
        x, w = T * din // q * f, din // q * dout // q * f
        c[("tp.row.broadcast", x)] += 2 * q
        c[("tp.col.broadcast", w)] += 2 * q
        c[("tp.row.reduce_scatter", q * x)] += 1
        c[("tp.col.reduce_scatter", q * w)] += 1
        dep(w)
        if bias:
            c[("tp.col.allreduce", dout // q * f)] += 1
            dep(dout // q * f)

    def ln():
        c[("tp.row.allreduce", T * f)] += 2
        c[("tp.row.allreduce", 2 * T * f)] += 1
        c[("tp.col.allreduce", 2 * h // q * f)] += 1
        dep(2 * h // q * f)

    c[("tp.col.reduce_scatter", b // d * s * h // q * f)] += 1  # token embedding
    c[("tp.col.allgather", T * h // q * f)] += 1
    dep(V // q * h // q * f)
    c[("tp.col.allreduce", s * h // q * f)] += 1  # positions
    dep(s * h // q * f)
    for _ in range(L):
        ln(), lin(h, 3 * h), lin(h, h), ln(), lin(h, 4 * h), lin(4 * h, h)
    ln(), lin(h, V, bias=False)
    c[("tp.row.allreduce", T * f)] += 3  # loss: row max, target logit, sum of exponentials
    c[("tp.col.allreduce", f)] += 1  # loss: the batch blocks' means
    dep(f)
    return c


def expected_3d() -> Counter:
    T = b // (q * q) * s
    c = Counter()

    def lin(din, dout, parity, bias=True):
        a, cc = ("tp.l", "tp.j") if parity == 0 else ("tp.j", "tp.l")
        x, w, y = T * din // q * f, din // (q * q) * dout // q * f, T * dout // q * f
        c[(f"{cc}.allgather", x)] += 2  # forward, and again for the weight gradient
        c[("tp.i.allgather", w)] += 2  # forward, backward
        c[(f"{a}.reduce_scatter", q * y)] += 1
        c[(f"{a}.allgather", y)] += 1
        c[(f"{cc}.reduce_scatter", q * x)] += 1
        c[("tp.i.reduce_scatter", q * w)] += 1
        if bias:
            c[("tp.i.allreduce", dout // q * f)] += 1

    def ln():
        c[("tp.l.allreduce", T * f)] += 2
        c[("tp.l.allreduce", 2 * T * f)] += 1
        c[("tp.i.allreduce", 2 * h // q * f)] += 1
        c[("tp.j.allreduce", 2 * h // q * f)] += 1

    c[("tp.i.reduce_scatter", b * s * h // q * f)] += 1
    c[("tp.j.reduce_scatter", q * T * h // q * f)] += 1
    c[("tp.j.allgather", T * h // q * f)] += 1
    c[("tp.i.allgather", q * T * h // q * f)] += 1
    c[("tp.i.allreduce", s * h // q * f)] += 1  # positions
    c[("tp.j.allreduce", s * h // q * f)] += 1
    for _ in range(L):
        ln(), lin(h, 3 * h, 0), lin(h, h, 1), ln(), lin(h, 4 * h, 0), lin(4 * h, h, 1)
    ln(), lin(h, V, 0, bias=False)
    c[("tp.j.allreduce", T * f)] += 3
    c[("tp.i.allreduce", f)] += 1
    c[("tp.l.allreduce", f)] += 1
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


P = world.Get_size()
tr, tracer = make(P, MODE, world)
seen, par, act = measure(tr, tracer)
want = expected_3d() if MODE == "3d" else expected_2d()
if seen != want:
    diff = {k: (seen.get(k, 0), want.get(k, 0)) for k in set(seen) | set(want)
            if seen.get(k, 0) != want.get(k, 0)}
    sys.exit(f"rank {world.Get_rank()}: {MODE} collectives differ from the formulas "
             f"(seen, formula): {diff}")
if world.Get_rank() == 0:
    ref, rtr = make(1, "1d", MPI.COMM_SELF)
    _, par_one, act_one = measure(ref, rtr)
    # the weight matrices and tables: 1/q^2 (2d, 2.5d: replicated over depth by design) or
    # 1/q^3 (3d) exactly; the d-vectors (LayerNorm, biases, positions) are cut by one grid dim
    # only (1/q), replicated over the others by design
    def vector(p):
        return len(p.full_shape) == 1 or p.name.endswith("qkv.bias") or p.name == "embed.pos.weight"

    mat = sum(p.data.nbytes for p in tr.params if not vector(p))
    mat_one = sum(p.data.nbytes for p in ref.params if not vector(p))
    ideal_p = 1 / q**3 if MODE == "3d" else 1 / q**2
    ideal_a = 1 / q**3 if MODE == "3d" else 1 / (d * q * q)
    ratio_m, ratio_p, ratio_a = mat / mat_one, par / par_one, act / act_one
    print(f"{MODE}: bytes per rank per step {sum(n * k for (_, n), k in seen.items())}")
    print(f"{MODE}: params per rank {par} of {par_one} ({ratio_p:.4f}; matrices and tables "
          f"{ratio_m:.4f}, ideal {ideal_p}); activations {act} of {act_one} ({ratio_a:.4f}, "
          f"ideal {ideal_a})")
    bad = [n for n, r, i in (("matrices", ratio_m, ideal_p), ("activations", ratio_a, ideal_a))
           if abs(r / i - 1) > 0.05]
    if bad:
        sys.exit(f"{bad} per rank not within 5% of the ideal share of one rank's")
    print(f"ok {MODE} L={L}: {len(seen)} kinds of collective equal the formulas")
