"""The layer base class: parameters plus the saved context of every micro-batch in flight.

The contract ("Split backward", docs/architecture.md) is stated in ``nn/layers.py``'s module
doc; this module holds only the base class so that the container (``nn/sequential.py``) and
the concrete layers (``nn/layers.py``) both build on it without importing each other.
"""

from __future__ import annotations

from .params import Parameter


class Layer:
    """Base class. Subclasses set ``self.own_params`` and override the three passes."""

    def __init__(self, name=""):
        self.name = name
        self.own_params: list[Parameter] = []
        self._ctx: dict = {}

    # -- structure
    def children(self) -> list["Layer"]:
        return []

    def params(self) -> list[Parameter]:
        out = list(self.own_params)
        for c in self.children():
            out.extend(c.params())
        return out

    def in_flight(self) -> set:
        """Micro-batches whose context is still held, over this layer and its children."""
        keys = set(self._ctx)
        for c in self.children():
            keys |= c.in_flight()
        return keys

    def drop(self, mb) -> None:
        """Forget a micro-batch's saved context (recomputation and aborted steps)."""
        self._ctx.pop(mb, None)
        for c in self.children():
            c.drop(mb)

    # -- passes
    def forward(self, x, mb=0):
        raise NotImplementedError

    def backward_input(self, dy, mb=0):
        raise NotImplementedError

    def backward_weight(self, mb=0) -> None:
        """Default: no weights, nothing to do."""

    def backward(self, dy, mb=0):
        dx = self.backward_input(dy, mb)
        self.backward_weight(mb)
        return dx

    def backward_no_dx(self, dy, mb=0) -> None:
        """``backward_input`` where nobody needs dx (the model's first layers, whose input is
        data): keeps what ``backward_weight`` needs. Default: ``backward_input``, its result
        dropped (so a layer whose backward is a collective still takes part in it)."""
        self.backward_input(dy, mb)

    def backward_first(self, dy, mb=0) -> None:
        """``backward`` where nobody needs dx: ``backward_no_dx`` then ``backward_weight``."""
        self.backward_no_dx(dy, mb)
        self.backward_weight(mb)

    def __repr__(self):
        return f"{type(self).__name__}({self.name})"
