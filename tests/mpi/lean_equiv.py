"""Run under mpiexec: the lean NumPy + mpi4py loop (mpipar/mpi/bench/lean.py) computes what
mpipar computes, in float64, for one layout.

usage: lean_equiv.py LAYOUT   (single: 1 rank; dp, naive, gpipe, 1f1b: 2 ranks)
Both start from mpipar's initial weights and train on mpipar's batches for STEPS steps (SGD, no
momentum, no clipping); world rank 0 compares the losses of every step (relative error <= 1e-12)
and the gradients of step 0 (<= 1e-10).
"""

import sys

import numpy as np
from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.checkpoint import gather_full
from mpipar.config import load_config
from mpipar.mpi import ProcessGrid
from mpipar.mpi.bench.lean import MLP_SIZES, Lean
from mpipar.trace import Tracer
from mpipar.training import Trainer
from mpipar.training.optimizers import step_lr

STEPS = 3


def config(layout, world_size):
    pp = world_size if layout in ("naive", "gpipe", "1f1b") else 1
    dp = world_size if layout == "dp" else 1
    return load_config(None, {
        "model.kind": "mlp", "model.sizes": str(list(MLP_SIZES)), "model.activation": "relu",
        "model.task": "classification", "model.init_std": 0.05,
        "train.dtype": "float64", "train.steps": 10, "train.batch_size": 128, "train.lr": 0.05,
        "train.optimizer": "sgd", "train.momentum": 0.0, "train.weight_decay": 0.0,
        "train.warmup_steps": 0, "train.grad_clip": 0.0, "train.eval_interval": 0,
        "train.seed": 3, "parallel.dp": dp, "parallel.pp": pp,
        "parallel.schedule": "naive" if layout == "naive" else ("gpipe" if layout == "gpipe"
                                                               else "1f1b"),
        "parallel.microbatches": 1 if layout == "naive" else 4, "run.trace": False,
    })


def main():
    layout = sys.argv[1]
    world = MPI.COMM_WORLD
    cfg = config(layout, world.Get_size())
    backend = Backend("cpu", "float64")
    grid = ProcessGrid(cfg.parallel.dp, cfg.parallel.pp, 1, world=world, backend=backend)
    tr = Trainer(cfg, grid, Tracer(enabled=False), backend)
    start = gather_full(tr, what=("params",))
    start = world.bcast(start, root=0)
    n = len(MLP_SIZES) - 1
    params = [(start[f"params/layers.{i}.weight"].copy(), start[f"params/layers.{i}.bias"].copy())
              for i in range(n)]
    b = tr.run.bounds
    split = [b[c][0] for c in sorted(b)] + [n]
    lean = Lean(world, layout, params, cfg.parallel.microbatches, split=split)
    ours, theirs, lean_grads, grads = [], [], None, None
    for step in range(STEPS):
        x, y = tr.batches.get("train", step, cfg.train.batch_size)
        theirs.append(lean.step(x, y, step_lr(cfg, step)))
        if step > 0:
            ours.append(tr.train_step()["loss"])
            continue
        # step 0 as train_step does it, with the gradients kept for the comparison
        lean_grads = world.gather(lean.named_grads(), root=0)
        ls = tr.forward_backward()
        grads = gather_full(tr, what=("grads",))
        tr.update(ls)
        ours.append(tr.step_loss)
        tr.step += 1
    if world.Get_rank() != 0:
        return
    lean_grads = {k: v for part in lean_grads for k, v in part.items()}
    gerr = max(float(np.max(np.abs(lean_grads[k[6:]] - v)) / np.max(np.abs(v)))
               for k, v in grads.items())
    lerr = max(abs(a - b) / abs(a) for a, b in zip(ours, theirs))
    ok = gerr <= 1e-10 and lerr <= 1e-12 and len(grads) == 2 * n
    print(f"{'ok  ' if ok else 'FAIL'} lean {layout}: grad rel err {gerr:.1e}, loss rel err "
          f"{lerr:.1e} over {STEPS} steps", flush=True)
    if not ok:
        world.Abort(1)


if __name__ == "__main__":
    main()
