"""The lean reference: an MLP trained with nothing but NumPy and mpi4py, written plainly.

It is the floor a layout costs with only the math and the messages: no tracing, no buffer pools,
no schedule objects. The MLP is linears ``sizes[0] -> ... -> sizes[-1]`` with ReLU between them
and softmax cross-entropy on the last, SGD without momentum. Layouts (``LAYOUTS``):

- ``single``: one rank, ``microbatches`` micro-batches, gradients accumulated;
- ``dp``: every rank takes its contiguous 1/size of the global batch's rows; during the last
  micro-batch's backward each parameter's gradient starts a non-blocking ``Iallreduce`` as soon
  as it is final (``flat=True``: one ``Iallreduce`` of one flat gradient buffer at the end);
- ``naive``, ``gpipe``, ``1f1b``: two or more pipeline stages, rank r holding layers
  ``split[r]:split[r + 1]``, blocking ``Send`` / ``Recv`` (and ``Sendrecv`` where 1F1B pairs a
  send with a receive, as Megatron's ``send_forward_recv_backward`` does, so it cannot deadlock
  on a rendezvous). ``naive`` runs the whole batch as one micro-batch, layer after layer.

Each step ends with one all-reduce of the loss (every rank knows it), and the update. The math
matches mpipar's MLP (``x @ W + b``, W of shape (d_in, d_out), the loss of a micro-batch scaled
by 1 / microbatches, the data-parallel gradient averaged): tests/test_lean.py checks in float64
that both give the same losses and gradients. ``python -m mpipar.mpi.bench.lean`` times it;
experiments/lean_bench.py runs it beside mpipar, in its own job or in mpipar's (``world_comm``).
It lives in the MPI layer, the one place allowed to import mpi4py, and imports nothing else
from mpipar.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

try:
    from .phase_clock import PhaseClock
except ImportError:  # run by file path (experiments/lean_bench.py does): its folder is on the path
    from phase_clock import PhaseClock

LAYOUTS = ("single", "dp", "naive", "gpipe", "1f1b")
MLP_SIZES = (784, 128, 127, 126, 125, 124, 123, 10)


def init_params(sizes, seed=0, std=0.1, dtype=np.float32):
    """[(W, b)] per linear: W normal(0, std) of shape (d_in, d_out), b zeros."""
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((a, o)) * std).astype(dtype), np.zeros(o, dtype))
            for a, o in zip(sizes[:-1], sizes[1:])]


class Stage:
    """Layers ``lo:hi`` of the MLP; ``head``: the last layer is here (no ReLU after it)."""

    def __init__(self, params, head):
        self.params = params
        self.grads = [(np.zeros_like(w), np.zeros_like(b)) for w, b in params]
        self.head = head

    def forward(self, x):
        """Output and what the backward needs (each layer's input and ReLU output)."""
        saved = []
        n = len(self.params)
        for i, (w, b) in enumerate(self.params):
            z = x @ w
            z += b
            if i < n - 1 or not self.head:
                np.maximum(z, 0, out=z)
            saved.append((x, z))
            x = z
        return x, saved

    def backward(self, saved, dy, need_dx=True, on_final=None):
        """Accumulate the weight gradients; return the input gradient. ``on_final(i)``: layer i's
        gradients are final (called during the last micro-batch's backward)."""
        n = len(self.params)
        for i in reversed(range(n)):
            x, z = saved[i]
            if i < n - 1 or not self.head:
                dy = dy * (z > 0)
            gw, gb = self.grads[i]
            gw += x.T @ dy
            gb += dy.sum(axis=0)
            if on_final is not None:
                on_final(i)
            if i > 0 or need_dx:
                dy = dy @ self.params[i][0].T
        return dy

    def zero_grad(self):
        for gw, gb in self.grads:
            gw.fill(0)
            gb.fill(0)

    def sgd(self, lr):
        for (w, b), (gw, gb) in zip(self.params, self.grads):
            w -= lr * gw
            b -= lr * gb


def cross_entropy(logits, targets, scale):
    """(mean loss, d(scale * mean loss)/dlogits)."""
    n = logits.shape[0]
    e = logits - logits.max(axis=1, keepdims=True)
    picked = e[np.arange(n), targets]
    np.exp(e, out=e)
    s = e.sum(axis=1)
    loss = float((np.log(s) - picked).mean())
    e /= s[:, None]
    e[np.arange(n), targets] -= 1
    e *= scale / n
    return loss, e


def _chunks(a, m):
    k = a.shape[0] // m
    return [a[i * k:(i + 1) * k] for i in range(m)]


class Lean:
    """One rank's part of a lean run. ``params``: the full model [(W, b)] (this rank keeps its
    layers); ``split``: pipeline layouts, layer boundaries per stage (default: even)."""

    def __init__(self, comm, layout, params, microbatches, split=None, flat=False):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: choose one of {LAYOUTS}")
        self.comm, self.layout, self.flat = comm, layout, flat
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.m = 1 if layout == "naive" else microbatches
        n = len(params)
        if layout in ("single", "dp"):
            split = [0, n]
            lo, hi = 0, n
        else:
            split = list(split) if split else [n * r // self.size for r in range(self.size)] + [n]
            lo, hi = split[self.rank], split[self.rank + 1]
        self.split = split
        self.lo = lo
        self.stage = Stage(params[lo:hi], head=hi == n)
        self.dtype = params[0][0].dtype
        self.widths = [w.shape[0] for w, _ in params] + [params[-1][0].shape[1]]

    def step(self, x, y, lr, taken=False):
        """One training step on the global batch (x, y), or with ``taken`` on what ``take``
        gave this rank of it; returns the batch-mean loss."""
        self.stage.zero_grad()
        if self.layout == "dp" and not taken:
            x, y = _chunks(x, self.size)[self.rank], _chunks(y, self.size)[self.rank]
        xs, ys = _chunks(x, self.m), _chunks(y, self.m)
        run = {"single": self._local, "dp": self._dp}.get(self.layout, self._pipeline)
        loss = self._reduce_loss(run(xs, ys))
        self.stage.sgd(lr)
        return loss

    def take(self, X, Y, rows):
        """(inputs, classes) of the global batch ``rows`` of (X, Y) that this rank reads, as a
        training loop's sampler hands them out (for ``step(..., taken=True)``): a replica
        gathers its own block of rows, a pipeline stage the inputs only if it is the first and
        the classes only if it is the last (the others get an unread placeholder of their
        shape, so the micro-batches' sizes are known)."""
        if self.layout == "dp":
            rows = _chunks(rows, self.size)[self.rank]
        one_stage = self.layout in ("single", "dp")
        first, last = one_stage or self.rank == 0, one_stage or self.rank == self.size - 1
        n = len(rows)
        x = X[rows] if first else np.broadcast_to(X[0], (n, X.shape[1]))
        y = Y[rows] if last else np.broadcast_to(Y[0], (n,))
        return x, y

    def _reduce_loss(self, loss):
        """The step's loss, known on every rank: one all-reduce of one number."""
        total = np.array([loss], dtype=np.float64)
        if self.size > 1:
            self.comm.Allreduce(np.array([loss], dtype=np.float64), total)
        return float(total[0]) / (self.size if self.layout == "dp" else 1)

    # -- one rank and data parallel
    def _local(self, xs, ys, on_final=None):
        loss = 0.0
        for k, (x, y) in enumerate(zip(xs, ys)):
            out, saved = self.stage.forward(x)
            mb_loss, dy = cross_entropy(out, y, 1.0 / self.m)
            loss += mb_loss / self.m
            last = on_final if k == self.m - 1 else None
            self.stage.backward(saved, dy, need_dx=False, on_final=last)
        return loss

    def _dp(self, xs, ys):
        from mpi4py import MPI

        reqs = []
        if self.flat:
            loss = self._local(xs, ys)
            flat = np.concatenate([g.reshape(-1) for pair in self.stage.grads for g in pair])
            self.comm.Allreduce(MPI.IN_PLACE, flat)
            off = 0
            for pair in self.stage.grads:
                for g in pair:
                    g[...] = flat[off:off + g.size].reshape(g.shape)
                    off += g.size
        else:
            def start(i):
                for g in self.stage.grads[i]:
                    reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, g))
            loss = self._local(xs, ys, on_final=start)
            MPI.Request.Waitall(reqs)
        inv = 1.0 / self.size
        for gw, gb in self.stage.grads:
            gw *= inv
            gb *= inv
        return loss

    # -- pipeline parallel
    def _recv(self, peer, shape):
        buf = np.empty(shape, self.dtype)
        self.comm.Recv(buf, source=peer, tag=0)
        return buf

    def _pipeline(self, xs, ys):
        r, first, last = self.rank, self.rank == 0, self.rank == self.size - 1
        mb_rows = xs[0].shape[0]
        in_shape = (mb_rows, self.widths[self.lo])
        out_shape = (mb_rows, self.widths[self.split[r + 1]])
        saved, loss = {}, 0.0

        def fwd(k, x=None):
            nonlocal loss
            if x is None:
                x = xs[k] if first else self._recv(r - 1, in_shape)
            out, saved[k] = self.stage.forward(x)
            if last:
                mb_loss, dy = cross_entropy(out, ys[k], 1.0 / self.m)
                loss += mb_loss / self.m
                saved[k] = (saved[k], dy)
                return None
            saved[k] = (saved[k], None)
            return out

        def bwd(k, dy=None):
            s, dy_loss = saved.pop(k)
            if dy is None:
                dy = dy_loss if last else self._recv(r + 1, out_shape)
            return self.stage.backward(s, dy, need_dx=not first)

        if self.layout == "1f1b":
            self._one_f_one_b(fwd, bwd, in_shape, out_shape)
            return loss
        for k in range(self.m):  # naive (m = 1) and GPipe: every forward, then every backward
            out = fwd(k)
            if not last:
                self.comm.Send(out, dest=r + 1, tag=0)
            if self.layout == "naive":
                break
        for k in range(self.m):
            dx = bwd(k)
            if not first:
                self.comm.Send(dx, dest=r - 1, tag=0)
        return loss

    def _one_f_one_b(self, fwd, bwd, in_shape, out_shape):
        """Warm-up forwards, steady one forward / one backward, cool-down backwards; a send
        followed by a receive from the same neighbour is one ``Sendrecv``."""
        r, first, last = self.rank, self.rank == 0, self.rank == self.size - 1
        warm = min(self.size - r - 1, self.m)
        for k in range(warm):
            self.comm.Send(fwd(k), dest=r + 1, tag=0)
        x = None if first or warm == self.m else self._recv(r - 1, in_shape)
        for k in range(self.m - warm):
            out = fwd(warm + k, x)
            dy = None
            if not last:  # send_forward_recv_backward
                dy = np.empty(out_shape, self.dtype)
                self.comm.Sendrecv(out, dest=r + 1, sendtag=0, recvbuf=dy, source=r + 1)
            dx = bwd(k, dy)
            x = None
            if not first:  # send_backward_recv_forward (no forward left: a plain send)
                if k + warm + 1 < self.m:
                    x = np.empty(in_shape, self.dtype)
                    self.comm.Sendrecv(dx, dest=r - 1, sendtag=0, recvbuf=x, source=r - 1)
                else:
                    self.comm.Send(dx, dest=r - 1, tag=0)
        for k in range(self.m - warm, self.m):
            dx = bwd(k)
            if not first:
                self.comm.Send(dx, dest=r - 1, tag=0)

    def named_grads(self):
        """{mpipar parameter name: gradient} of this rank's layers."""
        out = {}
        for i, (gw, gb) in enumerate(self.stage.grads):
            out[f"layers.{self.lo + i}.weight"] = gw
            out[f"layers.{self.lo + i}.bias"] = gb
        return out


def world_comm():
    """A duplicate of the world: the loop's own communicator beside another library's."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Dup()


def lean_phases(clock, lean):
    """Time the lean loop's phases (the names experiments/lean_phases.py compares)."""
    mod = globals()
    clock.patch(Stage, "forward", "forward")
    clock.patch(Stage, "backward", "backward")  # with dp's Iallreduce posts (on_final)
    clock.patch(Stage, "zero_grad", "zero grads")
    clock.patch(Stage, "sgd", "optimizer")
    clock.patch(Lean, "_dp", "grad sync")  # the Waitall and the 1 / dp scaling
    clock.patch(Lean, "_reduce_loss", "step reduce")
    for name in ("_recv", "_pipeline"):  # the sends, receives and the schedule's loop
        clock.patch(Lean, name, "p2p")
    mod["cross_entropy"] = clock.wrap(cross_entropy, "loss")
    return lean


def synthetic_batch(rng, batch, sizes, dtype):
    """A random batch (inputs, integer classes): the benchmark's data."""
    x = rng.standard_normal((batch, sizes[0])).astype(dtype)
    return x, rng.integers(0, sizes[-1], size=batch)


def batches(rng, args, sizes, dtype, take=None):
    """step -> (inputs, classes). By default 4 fixed batches, cycled (they stay in cache: the
    floor of the math alone); with ``--data-rows N`` each step gathers the next ``batch`` rows
    of a shuffled order of N rows made once, a new order each epoch (what a training loop
    reading a data set pays: mpipar reads its synthetic MLP rows that way). ``take``: a
    ``Lean.take``, each batch then being what that rank reads of it (its replica's rows, a
    pipeline stage's inputs or classes only), as mpipar gathers; else the global batch."""
    if take is None:
        def take(X, Y, rows):
            return X[rows], Y[rows]
    if args.data_rows:
        x, y = synthetic_batch(rng, args.data_rows, sizes, dtype)
        n, k = args.data_rows, args.batch
        if k > n:
            raise SystemExit(f"--data-rows {n} is fewer than --batch {k}: give at least {k}")
        order = {}

        def draw(step):
            epoch, at = divmod(step * k, n)
            if epoch not in order:
                order.clear()
                order[epoch] = np.random.default_rng([0, epoch]).permutation(n)
            rows = order[epoch][at:at + k]
            if len(rows) < k:  # the batch runs into the next epoch
                nxt = np.random.default_rng([0, epoch + 1]).permutation(n)
                rows = np.concatenate([rows, nxt[:k - len(rows)]])
            return take(x, y, rows)
        return draw
    every = np.arange(args.batch)
    data = [take(*synthetic_batch(rng, args.batch, sizes, dtype), every) for _ in range(4)]
    return lambda step: data[step % 4]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpipar.mpi.bench.lean",
                                description="time the lean NumPy + mpi4py MLP loop")
    p.add_argument("--layout", choices=LAYOUTS, default="single")
    p.add_argument("--sizes", default=",".join(map(str, MLP_SIZES)))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--split", default="", help="pipeline layer boundaries, e.g. 0,3,7")
    p.add_argument("--flat", action="store_true", help="dp: one flat all-reduce")
    p.add_argument("--data-rows", type=int, default=0,
                   help="draw each step's rows from a set of this many, as mpipar's synthetic "
                        "data does (its MLP set has 3686 training rows); 0: cycle 4 fixed batches")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", default="", help="cProfile the timed steps into PREFIX.rankR.prof")
    p.add_argument("--phases", default="",
                   help="write each rank's median CPU time per step and phase (PhaseClock) "
                        "to PREFIX.rankR.json")
    return p.parse_args(argv)


def main(argv=None):
    from mpi4py import MPI

    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in args.sizes.split(",")]
    dtype = np.dtype(args.dtype)
    split = [int(s) for s in args.split.split(",")] if args.split else None
    lean = Lean(comm, args.layout, init_params(sizes, 0, 0.05, dtype), args.microbatches,
                split=split, flat=args.flat)
    batch = batches(np.random.default_rng(1), args, sizes, dtype, take=lean.take)
    if args.phases:
        return phases_main(comm, lean, batch, args)
    loss = 0.0
    for s in range(args.warmup):
        lean.step(*batch(s), args.lr, taken=True)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    comm.Barrier()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for s in range(args.steps):
        loss = lean.step(*batch(args.warmup + s), args.lr, taken=True)
    if prof:
        prof.disable()
    comm.Barrier()
    elapsed = time.perf_counter() - t0
    if prof:
        prof.dump_stats(f"{args.profile}.rank{comm.Get_rank()}.prof")
    if comm.Get_rank() == 0:
        print(json.dumps({"impl": "lean", "layout": args.layout, "steps": args.steps,
                          "seconds": elapsed, "samples_per_s": args.batch * args.steps / elapsed,
                          "loss": loss}), flush=True)


def phases_main(comm, lean, batch, args):
    """``--phases``: the steps one by one under a ``PhaseClock``; one JSON line per rank."""
    clock = PhaseClock()
    lean_phases(clock, lean)

    def one(s):
        lean.step(*timed_draw(s), args.lr, taken=True)
    timed_draw = clock.wrap(batch, "data")
    step = clock.wrap(one, "step")
    for s in range(args.warmup):
        step(s)
    clock.steps.clear()
    comm.Barrier()
    for s in range(args.steps):
        step(args.warmup + s)
    comm.Barrier()
    clock.dump(args.phases, comm.Get_rank(), impl="lean", layout=args.layout, steps=args.steps)


if __name__ == "__main__":
    main()
