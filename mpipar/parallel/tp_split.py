"""How each tensor-parallel mode cuts a transformer: pure rules, no arrays, no MPI.

One table per mode (1d Megatron, 2d Optimus, 2.5d Tesseract, 3d) says by how much a rank's
share of each kind of tensor is smaller than the full one, and which model sizes must divide
for the cut to exist. The layer factories of each mode (``parallel.tensor.Megatron1DLayers``,
``parallel.tensor_nd``) build exactly these shards; ``mpipar.models`` checks shapes and counts
parameters and activations with them, without building anything (tests/test_model_description.py
holds the two to each other).

Kinds of parameter: ``column.weight`` / ``column.bias`` (the first linear of a tp pair),
``row.weight`` / ``row.bias`` (the second), ``norm`` (LayerNorm gain and bias), ``token`` (the
embedding table), ``position`` (learned positions). Activation regions: ``residual`` (between
blocks and what a LayerNorm keeps), ``column_in`` (what a column linear keeps as its input: the
gathered sequence under sequence parallelism), ``inner`` (between the two linears of a pair:
q/k/v, attention heads, the MLP's hidden units, the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import tp_batch_shards, tp_grid_shape


@dataclass(frozen=True)
class TPSplit:
    """The cut of one tp mode on a grid ``shape`` (``layout.tp_grid_shape``)."""

    mode: str = "1d"
    shape: tuple = (1,)
    sequence_parallel: bool = False  # 1d only: the residual region holds 1/tp of the sequence

    @classmethod
    def of(cls, mode: str = "1d", tp: int = 1, depth: int = 1,
           sequence_parallel: bool = False) -> TPSplit:
        """The split of ``parallel.tp_mode`` over ``tp`` ranks; tp = 1 is the one-rank model
        whatever the mode (the trainer builds the 1d context then)."""
        if tp == 1:
            return cls()
        shape = tp_grid_shape(mode, tp, depth)
        return cls(mode, shape, bool(sequence_parallel) and mode == "1d")

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def q(self) -> int:
        """The side of the grid a hidden vector is cut over (tp itself in 1d)."""
        return self.shape[-1] if self.mode != "3d" else self.shape[0]

    @property
    def batch_shards(self) -> int:
        return tp_batch_shards(self.mode, self.shape)

    @property
    def seq_shards(self) -> int:
        return self.size if self.sequence_parallel else 1

    def params(self, kind: str) -> int:
        """How many times smaller a rank's shard of a parameter of ``kind`` is than the full one."""
        t, q = self.size, self.q
        if self.mode == "1d":
            return {"column.weight": t, "column.bias": t, "row.weight": t, "row.bias": 1,
                    "norm": 1, "token": t, "position": 1}[kind]
        matrix = q * q if self.mode in ("2d", "2.5d") else q ** 3  # replicated over 2.5d depth
        return {"column.weight": matrix, "column.bias": q, "row.weight": matrix, "row.bias": q,
                "norm": q, "token": matrix, "position": q}[kind]

    @property
    def heads(self) -> int:
        """Attention heads are cut over tp (1d) or over one side of the grid."""
        return self.size if self.mode == "1d" else self.q

    def tokens(self, region: str) -> int:
        """Over how many ranks the tokens of a micro-batch are cut in ``region``."""
        if self.mode == "1d":
            return self.size if self.sequence_parallel and region == "residual" else 1
        return self.batch_shards

    def hidden(self, region: str) -> int:
        """Over how many ranks the hidden (feature) axis is cut in ``region``."""
        if self.mode == "1d":
            return self.size if region == "inner" else 1
        return self.q

    def requirements(self, n_embd: int, n_head: int, vocab: int) -> list[tuple]:
        """[(field, value, divisor, what the divisor is)] that must divide for this cut."""
        t, q = self.size, self.q
        if t == 1:
            return []
        if self.mode == "1d":
            by = f"tp = {t}"
            return [("model.n_head", n_head, t, by), ("4 * model.n_embd (MLP width)", 4 * n_embd,
                                                      t, by), ("model.vocab_size", vocab, t, by)]
        if self.mode == "3d":
            return [("model.n_embd", n_embd, q * q, f"{q * q} (tp_mode 3d, q = {q})"),
                    ("model.n_head", n_head, q, f"{q} (tp_mode 3d, q = {q})"),
                    ("model.vocab_size", vocab, q * q, f"{q * q} (tp_mode 3d, q = {q})")]
        by = f"q = {q} (tp_mode {self.mode})"
        return [("model.n_embd", n_embd, q, by), ("model.n_head", n_head, q, by),
                ("model.vocab_size", vocab, q, by)]
