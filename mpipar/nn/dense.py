"""The dense fast path: a stack of plain linears, each followed by ReLU, GELU or nothing, run in
one loop instead of through every layer's methods.

A small MLP's layer is a few products of a few hundred microseconds in all; through its unit
(``Sequential``), ``Linear``, the kernel (``functional``) and ``ReLU`` each linear costs about a
dozen Python calls per micro-batch and pass, several microseconds each time (BENCHMARKS.md,
"Small models against the lean loop"). ``DenseStack`` runs the same kernels (``cpu.product``,
``cpu.matmul``, ``column_sums``, the ReLU / GELU kernels) on the same arrays in the same order,
so every output and gradient is the same, bit for bit (tests/test_dense_fast_path.py).

The saved context stays where the layers keep it, in the layer path's format (a linear's
``[x, dy]``, a ReLU's output, a GELU's ``(x, t)``), one entry per micro-batch: the two paths can
take turns on the same micro-batch (the executor's unit-by-unit last backward under data
parallelism calls the units themselves), and ``drop``, ``in_flight``, recomputation and weight
stashing work unchanged. Parameters are read at each call (``param.data`` and ``param.grad``
are rebound by ZeRO-1, the gradient buckets and PipeDream's weight stash).

Which stacks qualify (``dense_steps``): every leaf is a ``Linear`` of a 2-D weight (with or
without a 1-D bias) or a ``ReLU`` / ``GELU`` right after one, under plain ``Sequential``
containers (no subclass that overrides a pass). Anything else (tensor-parallel entries and
exits, ``Bias``, attention, LayerNorm, a subclass of any of these) keeps the layer path.
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import array_module
from . import cpu
from . import functional as F

_ndarray = np.ndarray
# a leaf's part in a dense stack: its class's own ``dense_role`` (set in the class body, so a
# subclass, which may compute something else, does not inherit it)
LINEAR, RELU, GELU = "linear", "relu", "gelu"


def _enabled() -> bool:
    v = os.environ.get("MPIPAR_DENSE", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MPIPAR_DENSE={v!r}: set it to 1 (the dense fast path, the default) "
                         "or 0 (every layer's own passes)")
    return v == "1"


# whether new Sequentials take the fast path where they qualify; MPIPAR_DENSE=0 turns it off
# for a whole run (every rank), to compare with the layer path
ENABLED = _enabled()


def role(layer):
    """``layer``'s part in a dense stack (LINEAR, RELU, GELU), or None."""
    return vars(type(layer)).get("dense_role")


def dense_steps(leaves) -> list | None:
    """[(linear, activation layer or None, RELU / GELU / None)] in forward order when the
    leaves (in forward order, ``Sequential`` gathers them) are linears of a 2-D weight and a
    1-D bias or none, each followed by at most one ReLU or GELU; else None."""
    steps: list = []
    for layer in leaves:
        r = role(layer)
        if r == LINEAR:
            if len(layer.w.shape) != 2 or (layer.b is not None and len(layer.b.shape) != 1):
                return None
            steps.append([layer, None, None])
        elif r in (RELU, GELU) and steps and steps[-1][1] is None:
            steps[-1][1:] = [layer, RELU if r == RELU else GELU]  # ours: compared by `is`
        else:
            return None
    return [tuple(s) for s in steps] or None


def _step(lin, act, kind, inline_y=False, inline_dx=False, inline_dw=False, ones=None):
    """One linear's entry in a plan: (weight, bias or None, the linear's saved contexts, the
    activation's or None, kind, forward inline, input gradient inline, weight gradient inline,
    the column sums' vector of ones or None). The parameters and context dicts are held
    directly: none of them is ever rebound (a parameter's ``data`` and ``grad`` are, and are
    read at each call), and after a micro-batch's products each attribute looked up through
    the layers is a cold read of another object (BENCHMARKS.md, "Ninth cuts")."""
    return (lin.w, lin.b, lin._ctx, None if act is None else act._ctx, kind,
            inline_y, inline_dx, inline_dw, ones)


class _Plan:
    """For one micro-batch shape (rows, dtype) and kernel-thread count: per linear, in forward
    order, its ``_step``."""

    def __init__(self, steps, rows, dtype):
        itemsize = np.dtype(dtype).itemsize
        # weights of another dtype than the arrays (never in a run: one backend dtype) change
        # the dtypes along the way: then nothing inline, the kernels decide as they do
        same = all(lin.w.data.dtype == dtype for lin, _, _ in steps)
        self.forward = []
        for lin, act, kind in steps:
            k, n = lin.w.shape
            self.forward.append(_step(
                lin, act, kind,
                same and cpu.inline_product(rows, k, n, itemsize),  # y = x @ W (+ b)
                same and cpu.inline_product(rows, n, k, itemsize),  # dx = dy @ W.T
                same and cpu.inline_product(k, rows, n, itemsize),  # dW += x.T @ dy
                None if lin.b is None or not same else F._ones(np, rows, dtype)))
        self.backward = self.forward[::-1]
        self.rest = self.backward[:-1]  # all but the first linear, in backward order


class DenseStack:
    """The passes of a qualifying Sequential (``dense_steps``), each in one loop. Arrays must
    be 2-D (rows, features); ``Sequential`` sends anything else down the layer path.

    On NumPy a product small enough for the calling thread is the ``matmul`` that
    ``cpu.product`` would make, called here (``_Plan``, made once per micro-batch shape), the
    bias gradient the ``ones @ dy`` of ``column_sums``; every other product, and every array of
    another module (CuPy), goes through ``cpu.product`` / ``cpu.matmul`` as the layers do."""

    def __init__(self, steps):
        self.steps = [tuple(s) for s in steps]
        self._plans: dict = {}

    def _plan(self, a):
        """The plan for arrays like ``a`` (a micro-batch's input, output gradient or saved
        input: the same rows), None off NumPy."""
        if type(a) is not _ndarray:
            return None
        key = (a.shape[0], a.dtype, cpu._threads)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # micro-batch shapes come and go (evaluation, resumes)
                self._plans.clear()
            plan = self._plans[key] = _Plan(self.steps, a.shape[0], a.dtype)
        return plan

    def forward(self, x, mb):
        plan = self._plan(x)
        if plan is None:
            return self._forward_any(x, mb)
        matmul, maximum = np.matmul, np.maximum
        for w, b, ctx, act_ctx, kind, inline, _, _, _ in plan.forward:
            ctx[mb] = [x, None]
            if inline:  # cpu.product's small branch
                x = matmul(x, w.data)
                if b is not None:
                    x += b.data
            else:
                x = cpu.product(np, x, w.data, None if b is None else b.data)
            if kind is RELU:
                maximum(x, 0.0, out=x)  # F.relu_forward, in place in the product's output
                act_ctx[mb] = x
            elif kind is not None:
                y, t = F.gelu_forward(x)
                act_ctx[mb] = (x, t)
                x = y
        return x

    def _forward_any(self, x, mb):
        """Any array module: the layers' kernels, called in the same order."""
        xp = array_module(x)
        for lin, act, kind in self.steps:
            lin._ctx[mb] = [x, None]
            b = lin.b
            x = cpu.product(xp, x, lin.w.data, None if b is None else b.data)
            if kind is RELU:
                x = act._ctx[mb] = F.relu_forward(x)
            elif kind is not None:
                y, t = F.gelu_forward(x)
                act._ctx[mb] = (x, t)
                x = y
        return x

    @staticmethod
    def _weight(w, b, x, dy, inline, ones) -> None:
        """F.linear_backward_weight: dW += x.T @ dy, db += the column sums of dy."""
        if x.ndim != 2:  # saved by the layer path from an input of more axes
            x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        g = w.grad
        if g.ndim != 2:
            g = g.reshape(g.shape[0], -1)
        if inline:  # cpu.matmul's accumulation on the calling thread, below the pool's size
            g += np.matmul(x.T, dy)
        else:
            cpu.matmul(np if type(g) is _ndarray else array_module(g), x.T, dy, g,
                       accumulate=True)
        if b is not None:
            gb = b.grad
            if gb.ndim != 1:
                gb = gb.reshape(-1)
            if ones is not None:  # column_sums: one vector-matrix product
                gb += ones @ dy
            else:
                F.column_sums(dy, gb)

    @staticmethod
    def _act_backward(act_ctx, kind, dy, mb):
        if kind is RELU:
            return dy * (act_ctx.pop(mb) > 0)  # F.relu_backward
        x, t = act_ctx.pop(mb)
        return F.gelu_backward(dy, x, t)

    def _steps(self, plan, which):
        """``plan``'s steps (``which``: "backward" or "rest"), or the general ones off NumPy
        (nothing inline, the layers' kernels)."""
        if plan is not None:
            return getattr(plan, which)
        steps = [_step(lin, act, kind) for lin, act, kind in self.steps]
        steps.reverse()
        return steps if which == "backward" else steps[:-1]

    def _both(self, steps, dy, mb):
        """Input and weight gradients of each linear of ``steps`` (backward order) in turn."""
        matmul, weight, act_backward = np.matmul, self._weight, self._act_backward
        for w, b, ctx, act_ctx, kind, _, inline_dx, inline_dw, ones in steps:
            if kind is RELU:
                dy = dy * (act_ctx.pop(mb) > 0)  # F.relu_backward
            elif kind is not None:
                dy = act_backward(act_ctx, kind, dy, mb)
            x = ctx.pop(mb)[0]
            wt = w.data.T
            dx = matmul(dy, wt) if inline_dx else cpu.product(_xp(dy), dy, wt)
            if inline_dw and ones is not None and x.ndim == 2:  # _weight, written out
                w.grad += matmul(x.T, dy)
                b.grad += ones @ dy
            else:
                weight(w, b, x, dy, inline_dw, ones)
            dy = dx
        return dy

    def backward(self, dy, mb):
        return self._both(self._steps(self._plan(dy), "backward"), dy, mb)

    def backward_first(self, dy, mb) -> None:
        """Both passes where nobody needs the input gradient (the model's first chunk)."""
        plan = self._plan(dy)
        dy = self._both(self._steps(plan, "rest"), dy, mb)
        w, b, ctx, act_ctx, kind, _, _, inline_dw, ones = self._steps(plan, "backward")[-1]
        if kind is not None:
            dy = self._act_backward(act_ctx, kind, dy, mb)
        self._weight(w, b, ctx.pop(mb)[0], dy, inline_dw, ones)

    def _inputs(self, steps, dy, mb):
        matmul, act_backward = np.matmul, self._act_backward
        for w, _, ctx, act_ctx, kind, _, inline_dx, _, _ in steps:
            if kind is not None:
                dy = act_backward(act_ctx, kind, dy, mb)
            ctx[mb][1] = dy  # kept for the weight pass
            wt = w.data.T
            dy = matmul(dy, wt) if inline_dx else cpu.product(_xp(dy), dy, wt)
        return dy

    def backward_input(self, dy, mb):
        return self._inputs(self._steps(self._plan(dy), "backward"), dy, mb)

    def backward_no_dx(self, dy, mb) -> None:
        """The input pass where nobody needs dx: the first linear keeps dy, computes nothing."""
        plan = self._plan(dy)
        dy = self._inputs(self._steps(plan, "rest"), dy, mb)
        lin, act, kind = self.steps[0]
        if kind is not None:
            dy = self._act_backward(act._ctx, kind, dy, mb)
        lin._ctx[mb][1] = dy

    def backward_weight(self, mb) -> None:
        first = self.steps[0][0]._ctx.get(mb)
        plan = None if first is None else self._plan(first[1])
        for w, b, ctx, _, _, _, _, inline_dw, ones in self._steps(plan, "backward"):
            x, dy = ctx.pop(mb)
            self._weight(w, b, x, dy, inline_dw and x.ndim == 2, ones if x.ndim == 2 else None)


def _xp(a):
    return np if type(a) is _ndarray else array_module(a)
