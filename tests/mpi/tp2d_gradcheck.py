"""Run under mpiexec -n 4: finite-difference checks of the 2D layers' split backward.

For each new layer (Linear2D, LayerNorm2D, Embedding2D, PositionEmbedding2D) and the 2D loss:
L = sum over ranks of <layer(x)_block, R_block> (one collective scalar). Each rank in turn
perturbs sampled entries of its own input block and parameter shards (the other ranks run the
same forwards unperturbed), and compares central differences with backward_input /
backward_weight. Also checks the 2D loss against the one-rank loss on the gathered logits.
"""

import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ for gradcheck
from gradcheck import rel_err  # noqa: E402

from mpipar.backend import Backend  # noqa: E402
from mpipar.checkpoint import _gather_full  # noqa: E402
from mpipar.config import load_config  # noqa: E402
from mpipar.mpi.grid import ProcessGrid  # noqa: E402
from mpipar.nn.layers import ParamFactory  # noqa: E402
from mpipar.nn.losses import CrossEntropyLoss  # noqa: E402
from mpipar.parallel.tensor_nd import tp_context  # noqa: E402
from mpipar.parallel.tensor_nd.layers2d import (  # noqa: E402
    CrossEntropy2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PositionEmbedding2D,
)

world = MPI.COMM_WORLD
backend = Backend("cpu", "float64")
cfg = load_config(None, {"parallel.tp": 4, "parallel.tp_mode": "2d", "train.batch_size": 4})
grid = ProcessGrid(1, 1, 4, world=world, backend=backend)
tp = tp_context(grid, cfg.parallel)
pf = ParamFactory(backend, seed=3, tp_rank=tp.rank, tp_size=tp.size, std=0.5)
B, S, D, V = 4, 3, 8, 12
q, i, j = tp.q, tp.i, tp.j
rng = np.random.default_rng(0)  # the same full tensors on every rank


def block(full, rows=True, cols=True):
    """This rank's (batch i, hidden j) block of a full (B, S, D) tensor."""
    nb, nc = full.shape[0] // q, full.shape[-1] // q
    out = full[i * nb:(i + 1) * nb] if rows else full
    return np.ascontiguousarray(out[..., j * nc:(j + 1) * nc] if cols else out)


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
ok &= check("Linear2D", Linear2D(pf, tp, "lin", D, 2 * D), block(xf),
            block(rng.normal(size=(B, S, 2 * D))))
ok &= check("Linear2D fused qkv", Linear2D(pf, tp, "qkv", D, 3 * D, w_shape=(D, 3, D),
                                           w_split=((0, 0), (2, 1)), b_shape=(3, D),
                                           b_split=((1, 1),)),
            block(xf), block(rng.normal(size=(B, S, 3 * D))))
ln = LayerNorm2D(pf, tp, "ln", D)
ln.g.data += block(rng.normal(size=(1, 1, D)), rows=False).reshape(-1)
ln.b.data += block(rng.normal(size=(1, 1, D)), rows=False).reshape(-1)
ok &= check("LayerNorm2D", ln, block(xf), block(rng.normal(size=(B, S, D))))
ids = rng.integers(0, V, size=(B, S))
ok &= check("Embedding2D", Embedding2D(pf, tp, "emb", V, D), ids,
            block(rng.normal(size=(B, S, D))), probe_x=False)
ok &= check("PositionEmbedding2D", PositionEmbedding2D(pf, tp, "pos", 5, D), block(xf),
            block(rng.normal(size=(B, S, D))))

# the loss: value equal to one rank's on the full logits, gradient by finite differences
logits = rng.normal(size=(B, S, V))
tg = rng.integers(0, V, size=(B, S))
ref = CrossEntropyLoss()
ref_loss = ref.forward(logits, tg, mb=0, scale=0.5)
ref_grad = ref.backward(mb=0)
ce = CrossEntropy2D(tp)
mine = ce.forward(block(logits), tg, mb=0, scale=0.5)
g = ce.backward(mb=0)
lerr = max(abs(mine - ref_loss) / ref_loss, rel_err(g, block(ref_grad)))
lerr = world.allreduce(lerr, op=MPI.MAX)
ok &= lerr < 1e-12
if world.Get_rank() == 0:
    print(f"{'ok  ' if lerr < 1e-12 else 'FAIL'} CrossEntropy2D vs one rank: {lerr:.1e}")
if not world.allreduce(ok, op=MPI.LAND):
    sys.exit(1)
