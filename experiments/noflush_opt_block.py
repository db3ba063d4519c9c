"""The cost of one optimizer update per cache block size: AdamW on the tiny GPT's first stage
(the default), or SGD / AdamW on the small or the 1024-wide MLP of ``lean_bench.py``.

usage: python experiments/noflush_opt_block.py [--reps N] [--blocks 8192,16384,...] [--cold]
           [--model tiny-stage|mlp|wide] [--optimizer adamw|sgd]

Continuous PipeDream updates each chunk once per micro-batch, so at m = 8 its optimizer costs
eight 1F1B optimizer steps per step: the largest term between it and 1F1B
(``noflush_feasible.py``'s ``opt``). The update is 13 element-wise passes over five arrays
(weights, gradients, both moments, one scratch), run block by block (``optim.OPT_BLOCK_ELEMENTS``)
so that a block's arrays stay in cache between passes; at 64K elements a block's five arrays
take 1.3 MB. This times ``AdamW.step`` on parameters shaped as the tiny GPT's first stage at
``--layout auto`` (120,448 elements in one packed group, 26 tensors, 9 decaying runs), with the
gradient refilled before each update (as a backward leaves it) and, with ``--cold``, an 8 MB
buffer read in between (as a forward and a backward would evict the caches), for each block
size, interleaved, and checks that every block size gives the same bits (the passes are
element-wise). Prints the median microseconds per update with and without ``zero_grad``, and
of the update followed by a fill of the whole gradient (how a flushing step zeroed them before
its update did). A block as large as the model (``--blocks`` of its size or more) is the update
in whole passes, one NumPy call per pass. Run it alone on the machine (about 20 s for the tiny
stage, a minute for the wide MLP); the numbers depend on the caches of the machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpipar.backend import Backend
from mpipar.nn import optim
from mpipar.nn.params import Parameter

N_EMBD, VOCAB, SEQ, BLOCKS = 64, 256, 64, 2


def tiny_stage():
    """(role, shape) of the tiny GPT's first stage: embeddings and two blocks."""
    e = N_EMBD
    block = [("norm", (e,)), ("norm", (e,)), ("weight", (e, 3 * e)), ("bias", (3 * e,)),
             ("weight", (e, e)), ("bias", (e,)), ("norm", (e,)), ("norm", (e,)),
             ("weight", (e, 4 * e)), ("bias", (4 * e,)), ("weight", (4 * e, e)), ("bias", (e,))]
    return [("embedding", (VOCAB, e)), ("embedding", (SEQ, e))] + block * BLOCKS


def mlp(sizes):
    """(role, shape) of an MLP's linears (weight, bias) in forward order."""
    return [x for a, b in zip(sizes, sizes[1:]) for x in (("weight", (a, b)), ("bias", (b,)))]


MODELS = {"tiny-stage": tiny_stage,
          "mlp": lambda: mlp((784, 128, 127, 126, 125, 124, 123, 10)),
          "wide": lambda: mlp((784,) + (1024,) * 6 + (10,))}
OPTIMIZERS = {"adamw": lambda ps: optim.AdamW(ps, 3e-3, weight_decay=0.1),
              "sgd": lambda ps: optim.SGD(ps, 3e-3)}


def make(backend, model="tiny-stage"):
    ps = [Parameter(f"p{i}", shape, backend, role=role, std=0.02, seed=1)
          for i, (role, shape) in enumerate(MODELS[model]())]
    flat = np.zeros(sum(p.size for p in ps), dtype=backend.dtype)
    off = 0
    for p in reversed(ps):  # the buckets' order
        p.grad = flat[off:off + p.size].reshape(p.shape)
        off += p.size
    return ps, flat


def main() -> int:
    ap = argparse.ArgumentParser(prog="experiments/noflush_opt_block.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--blocks", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-stage")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    a = ap.parse_args()
    sizes = [int(x) for x in a.blocks.split(",")]
    b = Backend("cpu", "float32")
    rng = np.random.default_rng(0)
    runs = {}
    modes = (False, True, "fill")  # plain, zero_grad, plain then a fill of the whole gradient
    for n in sizes:
        for zero in modes:
            ps, flat = make(b, a.model)
            runs[(n, zero)] = (ps, flat, OPTIMIZERS[a.optimizer](ps), [])
    size = runs[(sizes[0], False)][1].size
    grads = [rng.normal(scale=1e-2, size=size).astype(np.float32) for _ in range(4)]
    evict = np.ones(1 << 21, dtype=np.float32)  # 8 MB
    plain = optim.OPT_BLOCK_ELEMENTS, optim.SGD_ONE_BLOCK_ELEMENTS
    try:
        for rep in range(a.reps):
            for (n, zero), (_, flat, opt, times) in runs.items():
                optim.OPT_BLOCK_ELEMENTS = optim.SGD_ONE_BLOCK_ELEMENTS = n
                flat[...] = grads[rep % len(grads)]
                if a.cold:
                    evict.sum()
                t0 = time.perf_counter()
                opt.step(3e-3, zero_grad=zero is True)
                if zero == "fill":
                    flat.fill(0)
                times.append(time.perf_counter() - t0)
    finally:
        optim.OPT_BLOCK_ELEMENTS, optim.SGD_ONE_BLOCK_ELEMENTS = plain
    ref = runs[(sizes[0], False)][0]
    for (n, _zero), (ps, _, _, _) in runs.items():
        same = all(np.array_equal(p.data.view(np.uint32), q.data.view(np.uint32))
                   for p, q in zip(ps, ref))
        assert same, f"block {n}: not the bits of block {sizes[0]}"
    arrays = 5 if a.optimizer == "adamw" else 3  # weights, gradients, (moments,) scratch
    print(f"{a.optimizer} update of {a.model}: {size:,} float32 elements ({len(ref)} tensors), "
          f"median of {a.reps} {'after an 8 MB read' if a.cold else 'warm'}; the same bits at "
          "every size")
    print(f"{'block':>8s} {'blocks':>6s} {'MB/block':>8s} {'us':>8s} {'us zero_grad':>12s} "
          f"{'us + fill':>10s}")
    for n in sizes:
        med = [1e6 * float(np.median(runs[(n, z)][3])) for z in modes]
        print(f"{n:8d} {-(-size // n):6d} {arrays * 4 * min(n, size) / 1e6:8.2f} {med[0]:8.1f} "
              f"{med[1]:12.1f} {med[2]:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
