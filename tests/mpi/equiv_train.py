"""Run under mpiexec: every variant on this grid gives the one-rank losses and gradients.

usage: equiv_train.py DATA.h5 DP PP TP VARIANT [VARIANT ...]
VARIANT: schedule:microbatches[:v=V][:zero1][:sp][:recompute|:selective][:mlp][:2d|2.5d|3d]
         [:layout=STRING][:csv=PATH]
(csv=PATH: run torch's schedule CSV at PATH; the schedule name is then only a label)
World rank 0 also trains the one-rank model (on MPI.COMM_SELF) and compares, in float64:
gathered gradients of step 0 (relative error <= 1e-10) and the loss of every step (<= 1e-9).
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.checkpoint import gather_full
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.trace import Tracer
from mpipar.training import Trainer

STEPS = 3


def make_cfg(data, dp, pp, tp, variant, batch=None):
    """batch: the global batch (default 2 * dp * microbatches, so any micro-batch count fits)."""
    parts = variant.split(":")
    sched, m = parts[0], parts[1]
    flags = set(parts[2:])
    v = next((int(f[2:]) for f in flags if f.startswith("v=")), 1)
    mode = next((f for f in flags if f in ("2d", "2.5d", "3d")), "1d")
    # 2.5d and 3d cut a micro-batch's sequences into 4 blocks (d q, q^2): 4 per micro-batch
    per_mb = 4 if mode in ("2.5d", "3d") else 2
    layout = next((f[7:] for f in flags if f.startswith("layout=")), "")
    csv = next((f[4:] for f in flags if f.startswith("csv=")), "")
    over = {
        "train.dtype": "float64", "train.steps": STEPS,
        "train.batch_size": batch or per_mb * dp * int(m),
        "train.seq_len": 8, "train.lr": 1e-2, "train.warmup_steps": 0, "train.grad_clip": 0.5,
        "train.eval_interval": 0, "train.seed": 5,
        "parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.schedule": "1f1b" if csv else sched,
        "parallel.microbatches": m, "parallel.virtual_stages": v, "parallel.layout": layout,
        "parallel.schedule_file": csv,
        "parallel.zero1": "zero1" in flags, "parallel.sequence_parallel": "sp" in flags,
        "parallel.recompute": "selective" if "selective" in flags else "recompute" in flags,
        "parallel.bucket_mb": 0.01,
        "parallel.tp_mode": mode, "parallel.tp_depth": 2 if mode == "2.5d" else 1,
        "run.trace": False, "data.path": data, "model.init_std": 0.2,
    }
    if "mlp" in flags:
        over.update({"model.kind": "mlp", "model.sizes": "[12, 16, 24, 16, 8, 8, 4, 8, 6]",
                     "model.init_std": 0.4})
    else:
        over.update({"model.n_layer": 6, "model.n_embd": 16, "model.n_head": 4,
                     "model.block_size": 8})
    return load_config(None, over)


DEVICE = os.environ.get("MPIPAR_TEST_DEVICE", "cpu")  # cuda: the same checks on CuPy


def run(cfg, world):
    g = cfg.parallel
    backend = Backend(DEVICE, "float64")
    grid = ProcessGrid(g.dp, g.pp, g.tp, world=world, tracer=None, backend=backend)
    tr = Trainer(cfg, grid, Tracer(enabled=False), backend, cfg.data.path)
    losses = []
    grads = None
    for step in range(STEPS):
        ls = tr.forward_backward()
        if step == 0:
            grads = gather_full(tr, what=("grads",))
        tr.update(ls)  # as train_step: the norm and the loss in one all-reduce
        losses.append(tr.step_loss)
        tr.step += 1
    params = gather_full(tr, what=("params",))
    return losses, grads, params


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def main():
    data, dp, pp, tp = sys.argv[1], *map(int, sys.argv[2:5])
    world = MPI.COMM_WORLD
    failures = []
    for variant in sys.argv[5:]:
        cfg = make_cfg(data, dp, pp, tp, variant)
        losses, grads, params = run(cfg, world)
        if world.Get_rank() == 0:
            ref = "pipedream-2bw:1" if variant.startswith("pipedream-2bw") else "1f1b:1"
            ref_cfg = make_cfg(data, 1, 1, 1, ref + (":mlp" if "mlp" in variant else ""),
                               batch=cfg.train.batch_size)
            ref_losses, ref_grads, ref_params = run(ref_cfg, MPI.COMM_SELF)
            assert set(grads) == set(ref_grads), (set(grads) ^ set(ref_grads))
            # ZeRO-1 keeps reduced gradients only as dp slices: its check is the weights after
            # the steps (and the losses), which every variant must match too
            gerr = (0.0, "-") if cfg.parallel.zero1 else max(
                (rel(grads[k], ref_grads[k]), k) for k in ref_grads)
            perr = max((rel(params[k], ref_params[k]), k) for k in ref_params)
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            ok = gerr[0] <= 1e-10 and lerr <= 1e-9 and perr[0] <= 1e-9
            print(f"{'ok  ' if ok else 'FAIL'} dp{dp} pp{pp} tp{tp} {variant}: grad rel err "
                  f"{gerr[0]:.1e} ({gerr[1]}), weights after {STEPS} steps {perr[0]:.1e}, "
                  f"loss {lerr:.1e}", flush=True)
            if not ok:
                failures.append(variant)
    bad = world.bcast(failures, root=0)
    if bad:
        sys.exit(f"variants differ from one rank: {bad}")


if __name__ == "__main__":
    main()
