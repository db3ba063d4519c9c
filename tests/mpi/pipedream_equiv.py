"""Run under mpiexec: asynchronous PipeDream equals its one-rank replay with the same staleness.

usage: pipedream_equiv.py DATA.h5 DP PP TP MICROBATCHES
The replay (world rank 0, no MPI) applies the rules the schedule implies: micro-batch mb runs
chunk c forward and backward with weight version ``weight_versions(schedule)[(mb, c)]`` (weight
stashing) and its gradient, averaged over dp replicas, updates chunk c right away (one AdamW per
chunk). Losses of every step and the weights after STEPS steps must agree (float64).
"""

import sys

import numpy as np
from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.checkpoint import gather_full
from mpipar.config import load_config
from mpipar.models import build_model
from mpipar.mpi.grid import ProcessGrid
from mpipar.nn.optim import AdamW
from mpipar.parallel.pipeline.generators import build_schedule, weight_versions
from mpipar.trace import Tracer
from mpipar.training import Batches, Trainer, chunk_bounds, step_lr

STEPS = 3


def make_cfg(data, dp, pp, tp, m):
    return load_config(None, {
        "train.dtype": "float64", "train.steps": STEPS, "train.batch_size": 2 * dp * m,
        "train.seq_len": 8, "train.lr": 1e-2, "train.warmup_steps": 0, "train.eval_interval": 0,
        "train.seed": 3, "parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.schedule": "pipedream", "parallel.microbatches": m, "run.trace": False,
        "data.path": data, "model.n_layer": 4, "model.n_embd": 16, "model.n_head": 4,
        "model.block_size": 8, "model.init_std": 0.2})


def replay(cfg):
    backend = Backend("cpu", "float64")
    p, t = cfg.parallel, cfg.train
    model = build_model(cfg.model, backend, seed=t.seed)
    sched = build_schedule("pipedream", p.pp, p.microbatches)
    versions = weight_versions(sched)
    bounds = chunk_bounds(cfg, model, sched)
    chunk_params = {c: model.params(model.units[lo:hi]) for c, (lo, hi) in bounds.items()}
    opts = {c: AdamW(ps, t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
            for c, ps in chunk_params.items()}
    batches = Batches(cfg, cfg.data.path)
    losses = []
    for step in range(STEPS):
        x, y = batches.get("train", step, t.batch_size)
        # micro-batch mb of every dp replica, side by side: their mean gradient is what dp averages
        rows = t.batch_size // p.dp // p.microbatches
        hist = {c: [[q.data.copy() for q in ps]] for c, ps in chunk_params.items()}
        lr = step_lr(cfg, step)
        total = 0.0
        for mb in range(p.microbatches):
            idx = np.concatenate([np.arange(rows) + d * rows * p.microbatches + mb * rows
                                  for d in range(p.dp)])
            for c, ps in chunk_params.items():
                for q, w in zip(ps, hist[c][versions[(mb, c)]]):
                    q.data[...] = w
                    q.zero_grad()
            h = x[idx]
            for u in model.units:
                h = u.forward(h, 0)
            total += model.loss.forward(h, y[idx], 0, 1.0)
            d = model.loss.backward(0)
            for u in reversed(model.units):
                d = u.backward(d, 0)
            for c, ps in chunk_params.items():
                for q, w in zip(ps, hist[c][mb]):  # the latest version, then update it
                    q.data[...] = w
                opts[c].step(lr)
                hist[c].append([q.data.copy() for q in ps])
        losses.append(total / p.microbatches)
    return losses, {f"params/{q.name}": q.data for ps in chunk_params.values() for q in ps}


def main():
    data, dp, pp, tp, m = sys.argv[1], *map(int, sys.argv[2:6])
    cfg = make_cfg(data, dp, pp, tp, m)
    backend = Backend("cpu", "float64")
    grid = ProcessGrid(dp, pp, tp, world=MPI.COMM_WORLD, backend=backend)
    tr = Trainer(cfg, grid, Tracer(enabled=False), backend, data)
    losses = []
    for _ in range(STEPS):
        losses.append(tr.train_step()["loss"])
    params = gather_full(tr, what=("params",))
    ok = True
    if grid.rank == 0:
        ref_losses, ref_params = replay(cfg)
        lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        perr = max(float(np.max(np.abs(params[k] - v)) / np.max(np.abs(v)))
                   for k, v in ref_params.items())
        ok = lerr <= 1e-9 and perr <= 1e-8  # Adam magnifies rounding where grads are ~eps
        print(f"{'ok  ' if ok else 'FAIL'} pipedream dp{dp} pp{pp} tp{tp} m{m}: loss rel err "
              f"{lerr:.1e}, weights rel err {perr:.1e}", flush=True)
    if not MPI.COMM_WORLD.bcast(ok, root=0):
        sys.exit("asynchronous PipeDream differs from its one-rank replay")


if __name__ == "__main__":
    main()
