"""Run under mpiexec by experiments/tp_modes.py: one tensor-parallel mode, a few steps.

usage: mpiexec -n N python experiments/tp_modes_driver.py --tp T --mode MODE --steps S
       [--set section.key=value ...]

Per rank: the bytes handed to tensor-parallel collectives per step (every ``tp.*`` event of
the tracer: the whole tp group's, 2D's ``tp.row.*`` / ``tp.col.*``, 3D's ``tp.i.*`` ...), the
parameter bytes, the activation bytes held after the forward of one micro-batch (saved
contexts, de-duplicated by buffer, as experiments/memory_driver.py counts them), and the median
step time (step 0 skipped). World rank 0 prints one line ``RESULT {json}`` with the mean and
max over ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    from memory_driver import _layer_arrays, held_bytes

    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.mpi import ProcessGrid, world_size_and_rank
    from mpipar.trace import Tracer
    from mpipar.training import Trainer, preflight, prepare_data

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--mode", default="1d")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    over = dict(s.split("=", 1) for s in a.set)
    over.update({"parallel.tp": a.tp, "parallel.tp_mode": a.mode, "run.trace": True,
                 "train.steps": a.steps, "train.eval_interval": 0})
    cfg = load_config(None, over)
    world_size, rank = world_size_and_rank()
    schedule = preflight(cfg, world_size)
    backend = Backend("cpu", cfg.train.dtype)
    tracer = Tracer(enabled=True, backend=backend, rank=rank)
    grid = ProcessGrid(1, 1, a.tp, tracer=tracer, backend=backend)
    tr = Trainer(cfg, grid, tracer, backend, prepare_data(cfg, grid), resolved=schedule)
    times = []
    for _ in range(a.steps):
        grid.world_comm.barrier()
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    ev = tracer.events()
    kinds = np.array([k.decode() if isinstance(k, bytes) else str(k) for k in ev["kind"]])
    tp_ev = np.char.startswith(kinds, "tp") & (ev["step"] == a.steps - 1)
    nbytes = float(ev["bytes"][tp_ev].sum())
    x, _ = tr.batches.get("train", 0, cfg.train.batch_size // cfg.parallel.microbatches)
    x = backend.xp.asarray(x)
    for u in tr.model.units:
        x = u.forward(x, mb=99)
    arrays = []
    for u in tr.model.units:
        _layer_arrays(u, arrays)
    act = held_bytes(arrays)
    mine = {"bytes": nbytes, "params": sum(p.data.nbytes for p in tr.params), "act": act,
            "step_s": float(np.median(times[1:] if len(times) > 1 else times))}
    blobs = grid.world_comm.gather_bytes(json.dumps(mine).encode(), root=0, trace=False)
    if rank == 0:
        allr = [json.loads(b) for b in blobs]
        out = {"tp": a.tp, "mode": a.mode, "ranks": world_size,
               "n_params_full": tr.model.n_params_full}
        for k in mine:
            out[k] = float(np.mean([r[k] for r in allr]))
            out[k + "_max"] = float(np.max([r[k] for r in allr]))
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
