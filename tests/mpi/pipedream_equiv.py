"""Run under mpiexec: asynchronous PipeDream (or PipeDream-2BW) equals its one-rank replay with
the same weight versions.

usage: pipedream_equiv.py DATA.h5 DP PP TP MICROBATCHES [KIND [MODE]]
KIND: pipedream (default) or pipedream-2bw. MODE: ``step`` (a flush after every step, the
default), ``continuous`` (no flush: one continuous schedule for all STEPS steps), ``vsync``
(continuous with vertical sync), ``drains`` (continuous, drained after step 1 as before an
evaluation or a checkpoint), ``recompute`` (continuous, with full recomputation), ``auto``
(continuous, stages cut by ``parallel.layout = "auto"``).
The replay (world rank 0, no MPI) applies the rules the schedule implies: micro-batch j runs
chunk c forward and backward with weight version ``weight_versions(schedule)[(j, c)]`` (weight
stashing) and its gradient, averaged over dp replicas, updates chunk c at the schedule's UPDATE
(PipeDream: right away; 2BW: the step's summed gradient after its last micro-batch, the current
weights becoming the older buffer), one AdamW per chunk. Losses of every step and the weights
after STEPS steps must agree (float64).
"""

import sys

import numpy as np
from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.checkpoint import gather_full
from mpipar.config import load_config
from mpipar.models import build_model
from mpipar.mpi import ProcessGrid
from mpipar.nn.optim import AdamW
from mpipar.parallel.pipeline.generators import build_schedule, weight_versions
from mpipar.trace import Tracer
from mpipar.training import Batches, Trainer, stage_bounds, step_lr

STEPS = 4
SEGMENTS = {"step": [1] * STEPS, "continuous": [STEPS], "vsync": [STEPS], "drains": [2, 2],
            "recompute": [STEPS], "auto": [STEPS]}


def make_cfg(data, dp, pp, tp, m, kind="pipedream", mode="step"):
    return load_config(None, {
        "train.dtype": "float64", "train.steps": STEPS, "train.batch_size": 2 * dp * m,
        "train.seq_len": 8, "train.lr": 1e-2, "train.warmup_steps": 0, "train.eval_interval": 0,
        "train.seed": 3, "parallel.dp": dp, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.schedule": kind, "parallel.microbatches": m, "run.trace": False,
        "parallel.continuous": mode != "step", "parallel.vertical_sync": mode == "vsync",
        "parallel.recompute": mode == "recompute",
        "parallel.layout": "auto" if mode == "auto" else "",
        "data.path": data, "model.n_layer": 4, "model.n_embd": 16, "model.n_head": 4,
        "model.block_size": 8, "model.init_std": 0.2})


class Replay:
    """One rank, no MPI: the model, one AdamW per chunk, each chunk's weight versions."""

    def __init__(self, cfg):
        backend = Backend("cpu", "float64")
        p, t = cfg.parallel, cfg.train
        self.cfg, self.kind = cfg, p.schedule
        self.model = build_model(cfg.model, backend, seed=t.seed)
        bounds = stage_bounds(cfg, 1)
        self.chunks = {c: self.model.params(self.model.units[lo:hi])
                       for c, (lo, hi) in bounds.items()}
        self.opts = {c: AdamW(ps, t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                              weight_decay=t.weight_decay) for c, ps in self.chunks.items()}
        self.batches = Batches(cfg, cfg.data.path)
        self.older = {c: self._copy(c) for c in self.chunks}  # 2BW: W(-1) = W(0)
        self.losses = []

    def _copy(self, c):
        return [q.data.copy() for q in self.chunks[c]]

    def _load(self, c, weights):
        for q, w in zip(self.chunks[c], weights):
            q.data[...] = w

    def segment(self, s0, n):
        """Steps s0 .. s0+n-1 as one schedule without a flush (n = 1: a flush every step)."""
        p, t = self.cfg.parallel, self.cfg.train
        m = p.microbatches
        sched = build_schedule(self.kind, p.pp, m, steps=n, vertical_sync=p.vertical_sync)
        versions = weight_versions(sched)
        hist = {c: {0: self._copy(c), -1: self.older[c]} for c in self.chunks}
        rows = t.batch_size // p.dp // m
        scale = 1.0 / m if self.kind == "pipedream-2bw" else 1.0
        total = 0.0
        for j in range(n * m):
            step, mb = s0 + j // m, j % m
            x, y = self.batches.get("train", step, t.batch_size)
            # micro-batch mb of every dp replica side by side: their mean gradient is dp's
            idx = np.concatenate([np.arange(rows) + d * rows * m + mb * rows
                                  for d in range(p.dp)])
            for c, ps in self.chunks.items():
                self._load(c, hist[c][versions[(j, c)]])
                if scale == 1.0 or mb == 0:
                    for q in ps:
                        q.zero_grad()
            h = x[idx]
            for u in self.model.units:
                h = u.forward(h, 0)
            total += self.model.loss.forward(h, y[idx], 0, scale)
            d = self.model.loss.backward(0)
            for u in reversed(self.model.units):
                d = u.backward(d, 0)
            if sched.updates_after(j):
                for c in self.chunks:  # the newest version, then update it
                    latest = max(hist[c])
                    self._load(c, hist[c][latest])
                    self.older[c] = hist[c][latest]
                    self.opts[c].step(step_lr(self.cfg, step))
                    hist[c][latest + 1] = self._copy(c)
            if mb == m - 1:
                self.losses.append(total / m)
                total = 0.0
        for c in self.chunks:
            self._load(c, hist[c][max(hist[c])])

    def params(self):
        return {f"params/{q.name}": q.data for ps in self.chunks.values() for q in ps}


def replay(cfg, segments):
    r, s0 = Replay(cfg), 0
    for n in segments:
        r.segment(s0, n)
        s0 += n
    return r.losses, r.params()


def main():
    data, dp, pp, tp, m = sys.argv[1], *map(int, sys.argv[2:6])
    kind = sys.argv[6] if len(sys.argv) > 6 else "pipedream"
    mode = sys.argv[7] if len(sys.argv) > 7 else "step"
    cfg = make_cfg(data, dp, pp, tp, m, kind, mode)
    segments = SEGMENTS[mode]
    backend = Backend("cpu", "float64")
    grid = ProcessGrid(dp, pp, tp, world=MPI.COMM_WORLD, backend=backend)
    tr = Trainer(cfg, grid, Tracer(enabled=False), backend, data)
    losses = []
    ends = np.cumsum(segments) - 1
    for i in range(STEPS):
        rec = tr.train_step(until=int(ends[np.searchsorted(ends, i)]))
        losses += [r["loss"] for r in tr.settle(rec)]  # continuous: read lagged (training.lagged)
    params = gather_full(tr, what=("params",))
    ok = True
    if grid.rank == 0:
        ref_losses, ref_params = replay(cfg, segments)
        assert len(losses) == len(ref_losses) == STEPS, (len(losses), len(ref_losses))
        lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        perr = max(float(np.max(np.abs(params[k] - v)) / np.max(np.abs(v)))
                   for k, v in ref_params.items())
        ok = lerr <= 1e-10 and perr <= 1e-8  # Adam magnifies rounding where grads are ~eps
        print(f"{'ok  ' if ok else 'FAIL'} {kind} {mode} dp{dp} pp{pp} tp{tp} m{m}: loss rel "
              f"err {lerr:.1e}, weights rel err {perr:.1e}", flush=True)
    if not MPI.COMM_WORLD.bcast(ok, root=0):
        sys.exit(f"{kind} ({mode}) differs from its one-rank replay")


if __name__ == "__main__":
    main()
