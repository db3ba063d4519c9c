"""Run under mpiexec by experiments/memory.py: train a few steps and measure activation memory.

usage: mpiexec -n N python experiments/memory_driver.py --config FILE --out RUN_DIR
       [--steps S] [--set section.key=value ...]

It builds ``mpipar.training.Trainer`` like ``mpipar train`` does and wraps the forward / backward
methods of this rank's pipeline chunks so that after every call it samples:

- the (micro-batch, chunk) pairs whose activations are held: saved layer contexts
  (``layer.in_flight()``) plus, with recomputation, the chunk inputs kept for the recompute;
- the bytes those hold: every array in the saved contexts, de-duplicated by the buffer it views
  (a layer keeps its input by reference, so a block's output is also the next layer's input);
- ``tracemalloc``'s traced memory (NumPy reports its buffers to tracemalloc), reset each step;
  also what it held after set-up (``traced_setup``) and its largest peak over the steps
  (``traced_max_peak``): NumPy-tracked bytes the steps add, for ``memory_peak.py``.

The statistics of the last step go into the dump as the ``memory`` attribute (JSON) of
``/ranks/<r>`` in RUN_DIR/trace.h5, next to the usual timing events.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tracemalloc
from pathlib import Path

import numpy as np


def _arrays(obj, out: list) -> None:
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _arrays(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _arrays(o, out)


def _layer_arrays(layer, out: list, mb=None) -> None:
    for key, ctx in layer._ctx.items():
        if mb is None or key == mb:
            _arrays(ctx, out)
    for child in layer.children():
        _layer_arrays(child, out, mb)


def held_bytes(arrays) -> int:
    """Bytes of distinct buffers behind ``arrays`` (views count their base once)."""
    seen = {}
    for a in arrays:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        seen[id(root)] = root.nbytes
    return sum(seen.values())


class Probe:
    """Samples held activations after every forward / backward call of this rank's chunks."""

    def __init__(self, chunks: dict, recompute: bool):
        self.chunks, self.recompute = chunks, recompute
        self.held = {}  # (mb, chunk) -> chunk input kept for recomputation
        self.pair_bytes = {}  # chunk -> bytes one micro-batch's forward leaves on it
        self.input_bytes = {}  # chunk -> bytes of one micro-batch's chunk input
        self.reset()
        for c, ch in chunks.items():
            self._wrap(ch, c)

    def reset(self) -> None:
        self.peak_pairs = 0
        self.peak_bytes = 0
        self.samples = 0

    def _wrap(self, ch, c) -> None:
        fwd, bwd_in, bwd_w = ch.forward, ch.backward_input, ch.backward_weight
        bwd_nodx = ch.backward_no_dx  # the model's first chunk: its input is data, no dx

        def forward(x, mb=0):
            y = fwd(x, mb)
            self.input_bytes.setdefault(c, int(x.nbytes))
            if self.recompute:
                self.held[(mb, c)] = x
            if c not in self.pair_bytes and mb in ch.in_flight():
                arrs = []
                _layer_arrays(ch, arrs, mb)
                self.pair_bytes[c] = held_bytes(arrs)
            self.sample()
            return y

        def backward_input(dy, mb=0):
            self.sample()  # after a recompute's forward: the rebuilt context is held now
            dx = bwd_in(dy, mb)
            self.held.pop((mb, c), None)
            self.sample()
            return dx

        def backward_no_dx(dy, mb=0):
            self.sample()
            bwd_nodx(dy, mb)
            self.held.pop((mb, c), None)
            self.sample()

        def backward_weight(mb=0):
            out = bwd_w(mb)
            self.sample()
            return out

        def both_passes(bwd):  # a BW action runs both passes layer by layer (executor)
            def backward(dy, mb=0):
                self.sample()
                out = bwd(dy, mb)
                self.held.pop((mb, c), None)
                self.sample()
                return out
            return backward

        ch.forward, ch.backward_input, ch.backward_weight = forward, backward_input, backward_weight
        ch.backward_no_dx = backward_no_dx
        ch.backward, ch.backward_first = both_passes(ch.backward), both_passes(ch.backward_first)

    def sample(self) -> None:
        pairs = set(self.held)
        arrays = list(self.held.values())
        for c, ch in self.chunks.items():
            pairs |= {(mb, c) for mb in ch.in_flight()}
            _layer_arrays(ch, arrays)
        self.peak_pairs = max(self.peak_pairs, len(pairs))
        self.peak_bytes = max(self.peak_bytes, held_bytes(arrays))
        self.samples += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args(argv)

    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.mpi import ProcessGrid, dump_trace, failfast, world_size_and_rank
    from mpipar.trace import Tracer
    from mpipar.training import Trainer, preflight, prepare_data

    over = dict(item.split("=", 1) for item in args.set)
    over.update({"train.steps": str(args.steps), "train.eval_interval": "0"})
    cfg = load_config(args.config, over)
    world_size, rank = world_size_and_rank()
    schedule = preflight(cfg, world_size)
    failfast.install()
    tracemalloc.start()  # before the model: the total includes parameters and optimizer state
    backend = Backend(cfg.train.device, cfg.train.dtype)
    tracer = Tracer(enabled=True, backend=backend, rank=rank)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, p.tp, order=p.order, tracer=tracer, backend=backend)
    trainer = Trainer(cfg, grid, tracer, backend, prepare_data(cfg, grid), resolved=schedule)
    probe = Probe(trainer.chunks, p.recompute)
    setup = tracemalloc.get_traced_memory()[0]  # the data set, model and optimizer made
    grid.world_comm.barrier()
    tracer.reset_clock()
    max_peak = 0
    for _ in range(args.steps):
        probe.reset()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        tracer.add_metrics(**trainer.train_step())
        peak = tracemalloc.get_traced_memory()[1]
        max_peak = max(max_peak, peak)
    stats = {
        "peak_pairs": probe.peak_pairs,
        "peak_ctx_bytes": probe.peak_bytes,
        "pair_bytes": {str(c): b for c, b in sorted(probe.pair_bytes.items())},
        "input_bytes": {str(c): b for c, b in sorted(probe.input_bytes.items())},
        "chunks": sorted(trainer.chunks),
        "traced_step_peak": peak - base,  # last step: peak above what the step started with
        "traced_peak": peak,
        "traced_setup": setup,  # the steps' own peak above set-up: max_peak - setup
        "traced_max_peak": max_peak,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "samples": probe.samples,
    }
    out = Path(args.out)
    if grid.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    grid.world_comm.barrier()
    dump_trace(tracer, grid, out / "trace.h5", {"config": cfg.to_dict(), "complete": True},
               rank_attrs={"memory": json.dumps(stats)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
