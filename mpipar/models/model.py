"""A built model: a flat list of pipeline units plus the loss applied after the last one."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..nn.layers import Layer


@dataclass
class Model:
    kind: str
    units: list[Layer]
    loss: object
    n_params_full: int = 0
    # last-axis width of each unit's output on this rank (what a pipeline sends after that unit)
    out_widths: list = field(default_factory=list)
    seq_shards: int = 1  # >1: activations between units hold 1/seq_shards of the sequence (SP)
    batch_shards: int = 1  # >1: ... hold 1/batch_shards of the sequences (2D tp: batch block)

    def boundary_shape(self, unit: int, batch: int, seq_len: int | None = None) -> tuple:
        """Shape of the activation leaving ``unit`` (and of its gradient) for a micro-batch."""
        if self.kind == "gpt":
            return (batch // self.batch_shards, seq_len // self.seq_shards,
                    self.out_widths[unit])
        return (batch, self.out_widths[unit])

    def params(self, units=None):
        seen, out = set(), []
        for u in self.units if units is None else units:
            for p in u.params():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def full_size(params) -> int:
    """Values in the full (unsharded) tensors of ``params``."""
    n = 0
    for p in params:
        k = 1
        for s in p.full_shape:
            k *= s
        n += k
    return n
