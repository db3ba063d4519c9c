"""``Sequential``: layers one after another, and its layer-by-layer backward plan.

Re-exported by ``nn/layers.py`` (``from mpipar.nn.layers import Sequential`` keeps working).
"""

from __future__ import annotations

from . import dense
from .base import Layer

# how ``Sequential.backward`` runs a layer: its own backward (a Sequential that interleaves its
# children), backward_input alone (no weights: Layer's backward_weight does nothing), or both
_NESTED, _INPUT, _BOTH = "nested", "input", "both"


class Sequential(Layer):
    def __init__(self, layers, name=""):
        super().__init__(name)
        self.layers = list(layers)
        # ``backward``'s plan: whether the passes are this class's (a subclass that overrides
        # one keeps the two sweeps), and per layer how to run both (``_plan``, at first use)
        self._interleave = self._plain()
        self._steps = None
        self._dense = None
        self.set_dense(None, nested=False)  # the children chose theirs when they were made

    # -- the dense fast path (``nn/dense.py``): plain linears with ReLU / GELU run in one loop,
    # the same kernels on the same arrays; 2-D arrays only, anything else takes the layer path
    def set_dense(self, on: bool | None = True, nested: bool = True) -> bool:
        """Use the dense fast path where this stack qualifies (``on``), or the layers' own
        passes (``on=False``: to compare the two); None: ``dense.ENABLED`` (MPIPAR_DENSE).
        ``nested``: the Sequentials inside too. Returns whether this one now uses it."""
        if nested:
            for layer in self.layers:
                if isinstance(layer, Sequential):
                    layer.set_dense(on)
        self._dense = None
        if dense.ENABLED if on is None else on:
            leaves = self._dense_leaves([])
            steps = None if leaves is None else dense.dense_steps(leaves)
            self._dense = dense.DenseStack(steps) if steps else None
        return self._dense is not None

    _PASSES = ("forward", "backward", "backward_first", "backward_input", "backward_no_dx",
               "backward_weight", "drop", "in_flight", "children", "params")

    def _dense_leaves(self, out):
        """The leaf layers in forward order, when this Sequential and every one inside it run
        Sequential's own passes (a subclass may add attributes, as the pipeline's Chunk does,
        but not change a pass); else None."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(Sequential, name) for name in self._PASSES):
            return None
        for layer in self.layers:
            if isinstance(layer, Sequential):
                if layer._dense_leaves(out) is None:
                    return None
            else:
                out.append(layer)
        return out

    @property
    def path(self) -> str:
        """"dense" (one loop over the linears) or "layers" (each layer's own passes)."""
        return "layers" if self._dense is None else "dense"

    def children(self):
        return self.layers

    def forward(self, x, mb=0):
        d = self._dense
        if d is not None and x.ndim == 2:
            return d.forward(x, mb)
        for layer in self.layers:
            x = layer.forward(x, mb)
        return x

    def backward_input(self, dy, mb=0):
        d = self._dense
        if d is not None and dy.ndim == 2:
            return d.backward_input(dy, mb)
        for layer in reversed(self.layers):
            dy = layer.backward_input(dy, mb)
        return dy

    def backward_no_dx(self, dy, mb=0):
        d = self._dense
        if d is not None and dy.ndim == 2:
            return d.backward_no_dx(dy, mb)
        layers = self.layers
        for layer in layers[:0:-1]:
            dy = layer.backward_input(dy, mb)
        if layers:
            layers[0].backward_no_dx(dy, mb)

    def backward_weight(self, mb=0):
        if self._dense is not None:  # any shape: the saved arrays say theirs
            return self._dense.backward_weight(mb)
        for layer in reversed(self.layers):
            layer.backward_weight(mb)

    # Both passes at once go layer by layer (each layer's input and weight gradients while its
    # saved input and dy are still in cache), not all inputs then all weights: the same
    # operations, the weight gradients accumulated in the same (reverse) order, so the same bits;
    # a small model's two sweeps re-read every layer's data from a farther cache level.
    def _plain(self) -> bool:
        """The passes are this class's (a subclass that overrides one keeps its own order)."""
        cls = type(self)
        return (cls.backward_input is Sequential.backward_input
                and cls.backward_weight is Sequential.backward_weight
                and cls.backward_no_dx is Sequential.backward_no_dx)

    def _plan(self) -> list:
        """[(layer, how)] in backward order, made once (the layers never change after
        construction): a plain Sequential runs its own interleaved ``backward``; a layer
        without a weight pass (Layer's, which does nothing) only its input pass."""
        self._steps = [(layer, _NESTED if isinstance(layer, Sequential) and layer._interleave
                        else _INPUT if type(layer).backward_weight is Layer.backward_weight
                        else _BOTH) for layer in reversed(self.layers)]
        return self._steps

    @staticmethod
    def _run(steps, dy, mb):
        """Both passes of each layer of ``steps`` in turn; the last input gradient."""
        for layer, how in steps:
            if how is _NESTED:
                dy = layer.backward(dy, mb)
            else:
                dy = layer.backward_input(dy, mb)
                if how is _BOTH:
                    layer.backward_weight(mb)
        return dy

    def backward(self, dy, mb=0):
        d = self._dense
        if d is not None and dy.ndim == 2:
            return d.backward(dy, mb)
        if not self._interleave:
            return super().backward(dy, mb)
        return self._run(self._steps if self._steps is not None else self._plan(), dy, mb)

    def backward_first(self, dy, mb=0) -> None:
        d = self._dense
        if d is not None and dy.ndim == 2:
            return d.backward_first(dy, mb)
        if not self._interleave:
            return super().backward_first(dy, mb)
        steps = self._steps if self._steps is not None else self._plan()
        dy = self._run(steps[:-1], dy, mb)
        if steps:
            steps[-1][0].backward_first(dy, mb)
