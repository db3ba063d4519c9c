"""Optimisers (SGD, AdamW), gradient-norm clipping and the learning-rate schedule.

They work on this rank's shards (``Parameter.data`` / ``.grad``, NumPy or CuPy) and know nothing
about ranks: an element-wise update of a shard equals the update of the full tensor, sliced.
The only place sharding matters is the gradient norm, where ``grad_norm_sq_local`` counts a
tensor-parallel replicated parameter on tp rank 0 only, so that a sum over tp and pp ranks (the
``reduce_sum`` the parallel layer passes in) counts every element once.

Everything stays in the parameter's dtype: hyperparameters are Python floats (NumPy 2 keeps
``float32_array * python_float`` in float32) and updates are in place, block by block,
through scratch buffers per thread, array module and dtype, not a temporary per expression. The
training loop sums gradients over micro-batches (the loss already scaled) before ``step``; the
optimisers read ``.grad``, and zero it after the read where ``step(zero_grad=True)`` asks.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np

from mpipar.backend import array_module
from mpipar.nn import cpu
from mpipar.nn.flat import flat_groups

# elements per cache block of an update on the CPU (AdamW: 5 arrays x 4 bytes x 64K = 1.3 MB)
OPT_BLOCK_ELEMENTS = 1 << 16
# an SGD group up to this size is one block: it is in cache already (a small model's gradients
# were just written), and each block costs a few Python calls (the 784-128-...-10 MLP's 181K
# values, ``experiments/noflush_opt_block.py --model mlp --optimizer sgd``: 151 us with the
# zeroing as one block, 157 in three 64K blocks)
SGD_ONE_BLOCK_ELEMENTS = 1 << 18
# every this many steps the state that decays towards zero is flushed of subnormal values
# (``flush_subnormals``); between flushes a value spends at most this many steps subnormal
FLUSH_EVERY = 16


def decays(p) -> bool:
    """Whether weight decay applies to ``p``: its declared role says so (``Parameter.decay``:
    matrices of linears and embeddings decay, biases and LayerNorm never, whatever their shape)."""
    return bool(p.decay)


class _Scratch:
    """Flat buffers per (array module, dtype, slot), as big as the largest block; views of
    them hold the intermediate results of an update (two slots when two are alive at once)."""

    def __init__(self):
        self._bufs = {}
        self._views = {}  # (array type, shape, dtype, slot) -> the view handed out for it

    def like(self, a, slot: int = 0, dtype=None):
        """A scratch view of ``a``'s shape, in ``a``'s dtype or ``dtype``."""
        # one dict look-up per parameter and step once its view is made (a view of an earlier,
        # smaller buffer stays valid: each is written before it is read, within one update)
        dtype = a.dtype if dtype is None else np.dtype(dtype)
        vkey = (type(a), a.shape, dtype, slot)
        view = self._views.get(vkey)
        if view is not None:
            return view
        xp = array_module(a)
        key = (xp.__name__, dtype.str, slot)
        buf = self._bufs.get(key)
        if buf is None or buf.size < a.size:
            buf = xp.empty(a.size, dtype=dtype)
            self._bufs[key] = buf
        view = self._views[vkey] = buf[: a.size].reshape(a.shape)
        return view


class Optimizer:
    """Shared bookkeeping: the parameter list, per-parameter state buffers, step count and
    ``state_dict`` / ``load_state_dict``. Subclasses name their buffers in ``BUFFERS``.

    The update runs over ``flat.FlatGroup``s: where the gradients lie packed in one buffer (the
    trainer's buckets), the parameters' data and state are packed to match at construction and
    a step is a handful of operations per group instead of per tensor; ``fused=False`` updates
    tensor by tensor (the same bits: the same element-wise operations in the same order)."""

    BUFFERS: tuple[str, ...] = ()

    def __init__(self, params, lr: float, fused: bool = True):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        names = [p.name for p in self.params]
        dupes = sorted(n for n, k in Counter(names).items() if k > 1)
        if dupes:
            raise ValueError(f"parameter names must be unique for the optimizer state, "
                             f"repeated: {dupes}")
        self.lr = _positive_float(lr, "lr", allow_zero=True)
        self.last_lr = self.lr
        self.step_count = 0
        self._local = threading.local()  # per kernel thread scratch (``_thread_scratch``)
        # Eager zero state: state_dict() is complete before the first step and memory use is
        # visible from the start.
        self.state = {p.name: {b: array_module(p.data).zeros_like(p.data) for b in self.BUFFERS}
                      for p in self.params}
        self.fused = bool(fused)
        self._lay_out()

    def _lay_out(self) -> None:
        self._groups = flat_groups(self.params, self.state, self.BUFFERS, self.fused)
        # a small model's whole update is shorter than waking the kernel threads (``step``)
        self._on_caller = sum(g.size for g in self._groups) < cpu.PARALLEL_MIN_ELEMENTS

    def groups(self) -> list:
        """The flat groups of this step: laid out again when a parameter's data or gradient
        was rebound since (the state and data are copied into the new layout, unchanged)."""
        for g in self._groups:  # (a loop, not all() over a generator: one frame less a step)
            if not g.valid():
                self._lay_out()
                break
        return self._groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self, lr: float | None = None, zero_grad: bool = False) -> None:
        """One update from the current ``.grad``; ``lr`` overrides the base lr for this step.
        ``zero_grad``: the gradients are zero afterwards, each block zeroed right after the
        update last reads it, while it is in cache (a separate pass over the gradients costs
        as much as the update's own: 3 ms of a 1024-wide MLP's 85 ms step).

        The update runs block by block (``OPT_BLOCK_ELEMENTS``), so that a block's parameters,
        gradients, state and scratch stay in cache between the passes of one update instead of
        streaming the whole model from memory once per pass (SGD on the 1024-wide MLP's 6.1M
        values, ``experiments/noflush_opt_block.py --model wide --optimizer sgd``: 7.4 ms in
        64K blocks with the zeroing, 11.5 ms in whole passes and a fill). The blocks of all
        groups go to the kernel threads in one batch (small groups would each pay a hand-off
        to the threads otherwise), unless all of them together are below
        ``cpu.PARALLEL_MIN_ELEMENTS``: a small model's whole update is shorter than waking the
        threads (15-50 us each), so the calling thread does it."""
        lr = self._begin_step(lr)
        groups = self.groups()
        if self._on_caller:  # all groups together below cpu.PARALLEL_MIN_ELEMENTS
            for g in groups:
                for update, rows in self._blocks(g, lr, zero_grad):
                    update(rows)
            return
        cpu.run_blocks([blk for g in groups for blk in self._blocks(g, lr, zero_grad)], _run)

    def _begin_step(self, lr) -> float:
        lr = self.lr if lr is None else _positive_float(lr, "lr", allow_zero=True)
        self.last_lr = lr
        self.step_count += 1
        return lr

    def _blocks(self, group, lr: float, zero_grad: bool) -> list:
        """[(update of one block, its slice)] for a ``flat.FlatGroup``; ``zero_grad``: each
        block's gradient zeroed after its last read."""
        raise NotImplementedError

    def _thread_scratch(self, like, slot: int = 0, dtype=None):
        """A scratch array like ``like`` (in ``dtype`` if given), this thread's own (blocks run
        on kernel threads)."""
        if not hasattr(self._local, "scratch"):
            self._local.scratch = _Scratch()
        return self._local.scratch.like(like, slot, dtype)

    def _flushes(self) -> bool:
        """Whether this step flushes the decaying state of subnormals (``flush_subnormals``):
        every ``FLUSH_EVERY``-th step, a function of the step count, so a resumed run flushes
        on the same steps as an unbroken one."""
        return self.step_count % FLUSH_EVERY == 0

    def _flush(self, xp, arrays, scratch) -> None:
        """``flush_subnormals`` on each of ``arrays`` (one block's state, in cache), with
        ``scratch`` (a float block like them, free now) and this thread's mask."""
        mask = self._thread_scratch(scratch, 0, bool)
        for a in arrays:
            flush_subnormals(xp, a, scratch, mask)

    def state_dict(self) -> dict:
        """{param name: {buffer name: copy (shard shape, param dtype), "step": int}}."""
        out = {}
        for p in self.params:
            xp = array_module(p.data)
            entry = {b: xp.array(self.state[p.name][b], copy=True) for b in self.BUFFERS}
            entry["step"] = self.step_count
            out[p.name] = entry
        return out

    def load_state_dict(self, state: dict) -> None:
        """Copy ``state`` (as from ``state_dict``, NumPy or CuPy arrays) into this optimizer's
        buffers, in the parameters' dtype and device. Checks names, keys and shapes first, so a
        failed load changes nothing."""
        ours = {p.name for p in self.params}
        missing, extra = sorted(ours - set(state)), sorted(set(state) - ours)
        if missing or extra:
            raise ValueError(f"{type(self).__name__}.load_state_dict: names do not match the "
                             f"parameters: missing {missing}, unexpected {extra}")
        steps = set()
        for p in self.params:
            entry = state[p.name]
            keys_needed = set(self.BUFFERS) | {"step"}
            if set(entry) != keys_needed:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {p.name} has keys "
                                 f"{sorted(entry)}, expected {sorted(keys_needed)} (a state from "
                                 "another optimizer or other settings?)")
            for b in self.BUFFERS:
                shape = tuple(entry[b].shape)
                if shape != tuple(p.data.shape):
                    raise ValueError(f"{type(self).__name__}.load_state_dict: {p.name}.{b} has "
                                     f"shape {shape}, the parameter shard is {tuple(p.data.shape)} "
                                     "(saved with another tensor-parallel size?)")
            steps.add(int(entry["step"]))
        if len(steps) != 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: parameters disagree on the "
                             f"step count: {sorted(steps)}")
        for p in self.params:
            xp = array_module(p.data)
            for b in self.BUFFERS:
                self.state[p.name][b][...] = xp.asarray(state[p.name][b], dtype=p.data.dtype)
        self.step_count = steps.pop()


def flush_subnormals(xp, a, scratch, mask) -> None:
    """Values of ``a`` smaller in magnitude than its dtype's smallest normal number set to zero,
    in place (``scratch``: a float array of ``a``'s shape and dtype, ``mask``: a bool one).

    Why: a moment whose gradient stays zero (a dead ReLU unit, an embedding row no batch
    reads) decays geometrically and spends 150-300 steps subnormal before it reaches zero, some
    for good (the decay rounds back to the same value), and x86 float arithmetic on a subnormal
    takes a microcode assist per element: with 4 % of a block subnormal, a multiply costs 15x
    its normal time, and AdamW on the ``mlp.toml`` model took 419 us a step at step 2,000
    against 153 us with the flush (``experiments/denormals.py``).
    Zero instead changes no update: such a moment moves a weight by less than 1e-30 of the
    learning rate, and a second moment below the smallest normal has a square root (< 1.1e-19)
    below half an ulp of AdamW's ``eps``. GPUs are not slowed, but they flush too: one result
    on every backend."""
    xp.abs(a, out=scratch)  # (a bitwise operation: no assist)
    xp.less(scratch, float(xp.finfo(a.dtype).tiny), out=mask)
    if xp is np and not mask.any():  # (on a GPU the test would wait for the device)
        return
    xp.copyto(a, 0, where=mask)


def _positive_float(x, what: str, allow_zero: bool = False) -> float:
    x = float(x)  # Python float: keeps float32 math in float32 under NumPy 2 promotion
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'} and finite, got {x}")
    return x


class SGD(Optimizer):
    """SGD with PyTorch's semantics: ``g = grad + weight_decay * p`` (weights and embeddings
    only, see ``decays``), ``buf = momentum * buf + g`` (so ``buf = g`` at the first step), then
    ``p -= lr * (g + momentum * buf)`` (nesterov) or ``p -= lr * buf``. Momentum 0:
    ``p -= lr * g``."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, fused: bool = True):
        self.momentum = _positive_float(momentum, "momentum", allow_zero=True)
        self.weight_decay = _positive_float(weight_decay, "weight_decay", allow_zero=True)
        if self.momentum >= 1.0:
            raise ValueError(f"momentum must be below 1, got {momentum}")
        if nesterov and self.momentum == 0.0:
            raise ValueError("nesterov needs momentum > 0")
        self.nesterov = bool(nesterov)
        self.BUFFERS = ("momentum_buffer",) if self.momentum > 0 else ()
        super().__init__(params, lr, fused)

    def _blocks(self, group, lr: float, zero_grad: bool) -> list:
        w, grad = group.data, group.grad
        xp = np if type(w) is np.ndarray else array_module(w)
        wd = self.weight_decay if group.decay_runs else 0.0
        momentum, nesterov = self.momentum, self.nesterov
        buf = group.state["momentum_buffer"] if momentum else None
        flush = bool(momentum) and self._flushes()  # the buffer decays where g stays zero

        def block(r):
            wb, gb = w[r], grad[r]
            g = gb
            if wd:  # g = wd * p + grad on the decaying elements, grad itself on the others
                g = self._thread_scratch(wb, 0)
                runs = [slice(None)] if group.all_decay else group.runs_in(r.start, r.stop)
                if not group.all_decay:
                    g[...] = gb
                for s in runs:
                    xp.multiply(wb[s], wd, out=g[s])
                    g[s] += gb[s]
            # the step lands in g itself where g is not read after it (Nesterov reads it) and
            # may be overwritten (a scratch, or a gradient zeroed below): one array fewer in
            # cache (the small MLP's 181K values with the zeroing, ``experiments/
            # noflush_opt_block.py --model mlp --optimizer sgd``: 90 against 124-164 us)
            if not nesterov and (g is not gb or zero_grad):
                step = g
            else:
                step = self._thread_scratch(wb, 1)
            if momentum:
                bb = buf[r]
                bb *= momentum
                bb += g
                if nesterov:
                    xp.multiply(bb, momentum, out=step)
                    step += g
                    step *= lr
                else:
                    xp.multiply(bb, lr, out=step)
            else:
                xp.multiply(g, lr, out=step)
            wb -= step
            if zero_grad:  # its last read was above: zeroed while in cache
                gb.fill(0)
            if flush:
                self._flush(xp, (bb,), self._thread_scratch(wb, 1))

        if w.size <= SGD_ONE_BLOCK_ELEMENTS:
            return [(block, slice(0, w.size))]
        return [(block, r) for r in cpu.row_blocks(xp, w.size, 1, OPT_BLOCK_ELEMENTS)]


class AdamW(Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter; PyTorch's
    AdamW): ``p *= 1 - lr * weight_decay`` (weights and embeddings only, see ``decays``),
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, and with ``t`` the step count
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    BUFFERS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, fused: bool = True):
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
        self.betas = (b1, b2)
        self.eps = _positive_float(eps, "eps")
        self.weight_decay = _positive_float(weight_decay, "weight_decay", allow_zero=True)
        super().__init__(params, lr, fused)

    def _blocks(self, group, lr: float, zero_grad: bool = False) -> list:
        """[(update of one block, its slice)] for a ``flat.FlatGroup`` (``zero_grad``: the
        block's gradient zeroed after its last read)."""
        w, g = group.data, group.grad
        xp = np if type(w) is np.ndarray else array_module(w)
        b1, b2 = self.betas
        t = self.step_count
        decay = 1.0 - lr * self.weight_decay if self.weight_decay and group.decay_runs else None
        c2 = 1.0 / math.sqrt(1.0 - b2**t)
        eps_c, step_c = self.eps / c2, lr / (1.0 - b1**t) / c2
        # flat arrays (a group's data, grads and state: flat.py); the 13 passes of one update
        # run block by block so that the five arrays' blocks stay in cache between passes
        # instead of streaming 80 MB from memory per pass (large config: 45 -> 36 ms); the
        # blocks go to the kernel threads (small config, one step: 7.7 ms on one, 5.1 on two)
        m, v = group.state["exp_avg"], group.state["exp_avg_sq"]
        flush = self._flushes()  # both moments decay where g stays zero

        def block(r):
            wb, gb, mb, vb = w[r], g[r], m[r], v[r]
            tb = self._thread_scratch(wb)
            if decay is not None:
                if group.all_decay:
                    wb *= decay
                else:  # only the decaying tensors' elements
                    for s in group.runs_in(r.start, r.stop):
                        wb[s] *= decay
            # m += (1 - b1) * (g - m)  ==  b1 m + (1 - b1) g
            xp.subtract(gb, mb, out=tb)
            tb *= 1.0 - b1
            mb += tb
            # v = b2 v + (1 - b2) g^2
            vb *= b2
            xp.multiply(gb, gb, out=tb)
            if zero_grad:  # its last read: zeroed while in cache, not in a pass of its own
                gb.fill(0)
            tb *= 1.0 - b2
            vb += tb
            # lr / (1 - b1^t) * m / (sqrt(v) c2 + eps) with c2 = 1 / sqrt(1 - b2^t), as
            # (lr / (1 - b1^t) / c2) * m / (sqrt(v) + eps / c2): one pass fewer
            xp.sqrt(vb, out=tb)
            tb += eps_c
            xp.divide(mb, tb, out=tb)
            tb *= step_c
            wb -= tb
            if flush:
                self._flush(xp, (mb, vb), tb)

        if w.size <= OPT_BLOCK_ELEMENTS:  # one block (what row_blocks would say), found directly
            return [(block, slice(0, w.size))]
        return [(block, r) for r in cpu.row_blocks(xp, w.size, 1, OPT_BLOCK_ELEMENTS)]


def _run(item) -> None:
    fn, arg = item
    fn(arg)


# ---------------------------------------------------------------------------------------------
# Gradient clipping
# ---------------------------------------------------------------------------------------------


def counts_in_norm(p) -> bool:
    """Whether this rank's shard of ``p`` counts in the global gradient norm: a sharded
    parameter always (each tp rank holds different elements), a replicated one only on tp rank 0
    (every tp rank holds the same copy); on a 2D/2.5D/3D tp grid, the copy at coordinate 0 of
    the grid dims it is replicated over (``ShardSpec.owns``)."""
    if p.spec.split:
        return p.spec.owns(p.tp_rank)
    return p.spec.axis is not None or p.tp_rank == 0


def grad_norm_sq_local(params) -> float:
    """Sum of squared gradient elements this rank is responsible for (see ``counts_in_norm``).
    Call it once the gradients are final (data-parallel all-reduce and the tp reduction of
    partial gradients done). Summed over the tp and pp ranks of one data-parallel replica (not
    over dp: replicas hold the same gradients), it gives the full model's squared norm.
    Accumulated in float64, with one device sync at the end."""
    total = None
    for p in params:
        if not counts_in_norm(p):
            continue
        xp = array_module(p.grad)
        g = p.grad.ravel()
        s = xp.vdot(g, g).astype(xp.float64)
        total = s if total is None else total + s
    return 0.0 if total is None else float(total)


class LocalGradNorm:
    """``grad_norm_sq_local(params)`` for a list of parameters that is the same every step,
    with the per-step work cut to a ``vdot`` per tensor: which tensors count and their flat
    views are found once, and kept while every parameter holds the same gradient array (a
    gradient rebound, or one not contiguous, is looked at again). NumPy gradients are summed
    as Python floats, in the same order as ``grad_norm_sq_local`` sums its float64 scalars:
    the same bits; any other array module takes ``grad_norm_sq_local`` itself."""

    def __init__(self, params):
        self.params = list(params)
        self._grads = None  # the gradient arrays the views were taken from
        self._flat = None  # [flat view or None (ravel per call)] of the counted tensors

    def _plan(self):
        grads = [p.grad for p in self.params]
        if self._grads is not None and all(a is b for a, b in zip(grads, self._grads)):
            return self._flat
        self._grads = grads
        counted = [p.grad for p in self.params if counts_in_norm(p)]
        if not all(type(g) is np.ndarray for g in counted):
            self._flat = None
        else:
            self._flat = [g.reshape(-1) if g.flags.c_contiguous else None for g in counted]
        self._counted = counted
        return self._flat

    def __call__(self) -> float:
        flat = self._plan()
        if flat is None:
            return grad_norm_sq_local(self.params)
        total = 0.0
        vdot = np.vdot
        for g, v in zip(self._counted, flat):
            if v is None:
                v = g.ravel()
            total += float(vdot(v, v))  # float32's vdot as grad_norm_sq_local takes it
        return total


def clip_grads_(params, max_norm: float, total_norm: float) -> float:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` in place; return the
    scale. ``total_norm`` must be the global norm (the same on every rank, so all ranks agree).
    A non-finite norm raises FloatingPointError on every rank alike instead of zeroing the grads."""
    max_norm = _positive_float(max_norm, "max_norm")
    total_norm = float(total_norm)
    if not math.isfinite(total_norm):
        raise FloatingPointError(f"gradient norm is {total_norm}: the loss diverged or overflowed; "
                                 "lower the learning rate (or use float64 to look for the cause)")
    scale = min(1.0, max_norm / (total_norm + 1e-6))
    if scale < 1.0:
        for p in params:
            p.grad *= scale
    return scale


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------------------------


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int,
          min_lr: float = 0.0) -> float:
    """Learning rate of the 0-based optimizer step ``step``.

    - warm-up, ``step < warmup_steps``: ``base_lr * (step + 1) / warmup_steps`` (linear, never 0,
      reaching ``base_lr`` at the last warm-up step);
    - then cosine decay from ``base_lr`` at ``step == warmup_steps`` to ``min_lr`` at
      ``step == total_steps`` (so the last of ``total_steps`` steps is just above ``min_lr``),
      and ``min_lr`` after it;
    - ``total_steps == 0``: no decay, ``base_lr`` after the warm-up (constant if no warm-up).
    """
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"step, warmup_steps and total_steps must be >= 0, got {step}, "
                         f"{warmup_steps}, {total_steps}")
    if total_steps and warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be below total_steps "
                         f"({total_steps}); lower --warmup or raise --steps")
    if min_lr > base_lr:
        raise ValueError(f"min_lr ({min_lr}) must not exceed the base lr ({base_lr})")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if total_steps == 0:
        return base_lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
