"""Run under mpiexec: finite-difference checks of the 2D / 2.5D / 3D layers' split backward.

usage: tp_nd_gradcheck.py MODE   (2d at 4 ranks; 2.5d (d = 2) and 3d at 8 ranks)
For each new layer (linear, fused q/k/v linear, LayerNorm, embedding, positions) and the loss:
L = sum over ranks of <layer(x)_block, R_block> (one collective scalar). Each rank in turn
perturbs sampled entries of its own input block (the other ranks run the same forwards
unperturbed); parameters are perturbed as entries of the full tensor, on every rank holding a
copy; central differences are compared with backward_input / backward_weight. The loss is
compared with the one-rank loss on the full logits.
"""

import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ for gradcheck
from gradcheck import rel_err  # noqa: E402

from mpipar.backend import Backend  # noqa: E402
from mpipar.checkpoint import _gather_full  # noqa: E402
from mpipar.config import load_config  # noqa: E402
from mpipar.mpi import ProcessGrid  # noqa: E402
from mpipar.nn.layers import ParamFactory  # noqa: E402
from mpipar.nn.losses import CrossEntropyLoss  # noqa: E402
from mpipar.parallel.tensor_nd import layers2d as L2  # noqa: E402
from mpipar.parallel.tensor_nd import layers3d as L3  # noqa: E402
from mpipar.parallel.tensor_nd import tp_context  # noqa: E402

MODE = sys.argv[1]
world = MPI.COMM_WORLD
backend = Backend("cpu", "float64")
P = world.Get_size()
cfg = load_config(None, {"parallel.tp": P, "parallel.tp_mode": MODE, "train.batch_size": 4,
                         "parallel.tp_depth": 2 if MODE == "2.5d" else 1})
grid = ProcessGrid(1, 1, P, world=world, backend=backend)
tp = tp_context(grid, cfg.parallel)
pf = ParamFactory(backend, seed=3, tp_rank=tp.rank, tp_size=tp.size, std=0.5)
B, S, D, V = 4, 3, 8, 16
rng = np.random.default_rng(0)  # the same full tensors on every rank


def block(full, parity=0, rows=True):
    """This rank's block of a full (B, S, D) tensor: (batch block, hidden block) of the layout
    (2D / 2.5D: batch block k q + i, hidden j; 3D parity 0: i q + j, l; parity 1: i q + l, j)."""
    if MODE == "3d":
        hid, piece = ("l", "j") if parity == 0 else ("j", "l")
        nb_blocks, bb, hb = tp.q ** 2, tp.batch_block(parity), tp.coord(hid)
    else:
        nb_blocks, bb, hb = tp.batch_shards, tp.batch_block, tp.j
    nb, nc = full.shape[0] // nb_blocks, full.shape[-1] // tp.q
    out = full[bb * nb:(bb + 1) * nb] if rows else full
    return np.ascontiguousarray(out[..., hb * nc:(hb + 1) * nc])


def err(num, ana):
    return rel_err([num], [ana]) if abs(num) > 1e-8 else abs(ana)


def numeric(loss, flat, k, perturb):
    """Central difference of the collective loss, entry k of flat changed where ``perturb``."""
    vals = []
    for eps in (1e-6, -1e-6):
        old = flat[k]
        if perturb:
            flat[k] = old + eps
        vals.append(loss())
        flat[k] = old
    return (vals[0] - vals[1]) / 2e-6


def check(name, layer, x, r, probe_x=True):
    """Analytic vs numeric gradients of L = sum <layer(x), r> over ranks."""
    def loss():
        y = layer.forward(x.copy() if probe_x else x, mb=9)
        layer.drop(9)
        return world.allreduce(float((y * r).sum()))

    layer.forward(x, mb=0)
    dx = layer.backward_input(r.copy(), mb=0)
    for p in layer.params():
        p.zero_grad()
    layer.backward_weight(mb=0)
    worst = 0.0
    # the input: each rank's own block in turn (the others run the same forwards unperturbed)
    if probe_x:
        flat = x.reshape(-1)
        for who in range(world.Get_size()):
            for k in np.random.default_rng(who).choice(flat.size, 4, replace=False):
                g = numeric(loss, flat, k, world.Get_rank() == who)
                if world.Get_rank() == who:
                    worst = max(worst, err(g, dx.reshape(-1)[k]))
    # parameters: entries of the full tensor, perturbed on every rank holding a copy (the
    # vectors cut by column are replicated over the column), against the assembled gradient
    for p in layer.params():
        full_grad = _gather_full(p.grad, p.spec, grid.tp_comm)
        sl = p.spec.block_index(p.full_shape, p.tp_rank)
        for fk in np.random.default_rng(7).choice(full_grad.size, 6, replace=False):
            at = np.unravel_index(fk, p.full_shape)
            mine = all(s.start <= a < s.stop for s, a in zip(sl, at))
            local = tuple(a - s.start for s, a in zip(sl, at)) if mine else None
            flat = p.data.reshape(-1)
            k = np.ravel_multi_index(local, p.shape) if mine else 0
            g = numeric(loss, flat, k, mine)
            worst = max(worst, err(g, full_grad.reshape(-1)[fk]))
    worst = world.allreduce(worst, op=MPI.MAX)
    if world.Get_rank() == 0:
        print(f"{'ok  ' if worst < 1e-6 else 'FAIL'} {name}: max rel err {worst:.1e}", flush=True)
    return worst < 1e-6


ok = True
xf = rng.normal(size=(B, S, D))
R1, R2, R3 = (rng.normal(size=(B, S, n * D)) for n in (1, 2, 3))
if MODE == "3d":
    layers = [
        ("Linear3D parity 0", L3.Linear3D(pf, tp, "lin", D, 2 * D, 0), block(xf), block(R2, 1)),
        ("Linear3D parity 1", L3.Linear3D(pf, tp, "lin1", D, D, 1), block(xf, 1), block(R1)),
        ("Linear3D fused qkv", L3.Linear3D(pf, tp, "qkv", D, 3 * D, 0, w_shape=(D, 3, D),
                                           axes=(0, 2), b_shape=(3, D), b_axis=1),
         block(xf), block(R3, 1)),
        ("LayerNorm3D", L3.LayerNorm3D(pf, tp, "ln", D), block(xf), block(R1)),
        ("Embedding3D", L3.Embedding3D(pf, tp, "emb", V, D), None, block(R1)),
        ("PositionEmbedding3D", L3.PositionEmbedding3D(pf, tp, "pos", 5, D), block(xf),
         block(R1)),
    ]
else:
    layers = [
        ("Linear2D", L2.Linear2D(pf, tp, "lin", D, 2 * D), block(xf), block(R2)),
        ("Linear2D fused qkv", L2.Linear2D(pf, tp, "qkv", D, 3 * D, w_shape=(D, 3, D),
                                           w_split=((0, "row"), (2, "col")), b_shape=(3, D),
                                           b_split=((1, "col"),)), block(xf), block(R3)),
        ("LayerNorm2D", L2.LayerNorm2D(pf, tp, "ln", D), block(xf), block(R1)),
        ("Embedding2D", L2.Embedding2D(pf, tp, "emb", V, D), None, block(R1)),
        ("PositionEmbedding2D", L2.PositionEmbedding2D(pf, tp, "pos", 5, D), block(xf),
         block(R1)),
    ]
ids = rng.integers(0, V, size=(B, S))
for name, layer, x, r in layers:
    for p in layer.params():  # LayerNorm: gains and biases away from 1 and 0
        if p.role == "norm":
            p.load_full(rng.normal(size=p.full_shape))
    ok &= check(f"{MODE} {name}", layer, ids if x is None else x, r, probe_x=x is not None)

# the loss: value equal to one rank's on the full logits, gradient by finite differences
logits = rng.normal(size=(B, S, V))
tg = rng.integers(0, V, size=(B, S))
ref = CrossEntropyLoss()
ref_loss = ref.forward(logits, tg, mb=0, scale=0.5)
ref_grad = ref.backward(mb=0)
ce = (L3.CrossEntropy3D if MODE == "3d" else L2.CrossEntropy2D)(tp)
parity = 1 if MODE == "3d" else 0
mine = ce.forward(block(logits, parity), tg, mb=0, scale=0.5)
g = ce.backward(mb=0)
lerr = max(abs(mine - ref_loss) / ref_loss, rel_err(g, block(ref_grad, parity)))
lerr = world.allreduce(lerr, op=MPI.MAX)
ok &= lerr < 1e-12
if world.Get_rank() == 0:
    print(f"{'ok  ' if lerr < 1e-12 else 'FAIL'} {MODE} loss vs one rank: {lerr:.1e}")
if not world.allreduce(ok, op=MPI.LAND):
    sys.exit(1)
