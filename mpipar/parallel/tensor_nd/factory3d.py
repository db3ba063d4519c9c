"""The layers of the 3D cut for ``mpipar.models``' description: every linear the 3D product on
the q x q x q cube, a column linear turning parity 0 into parity 1 and a row linear back (so a
block starts and ends in parity 0); LayerNorm, positions and biases cut by one dim of the cube."""

from __future__ import annotations

from ...nn.layers import CausalSelfAttention, Layer, Sequential
from .context3d import TP3DContext
from .layers3d import CrossEntropy3D, Embedding3D, LayerNorm3D, Linear3D, PositionEmbedding3D

PARITY_IN = {"column": 0, "row": 1}


class Cube3DLayers:
    def __init__(self, tp: TP3DContext, pf):
        self.tp, self.pf = tp, pf
        self.split = tp.split

    def norm(self, part) -> Layer:
        return LayerNorm3D(self.pf, self.tp, part.name, part.d)

    def linear(self, part) -> list[Layer]:
        w, b = part.w_shape, part.b_shape
        return [Linear3D(self.pf, self.tp, part.name, part.d_in, part.d_out,
                         PARITY_IN[part.cut], bias=part.bias, w_shape=w, axes=(0, len(w) - 1),
                         b_shape=b, b_axis=len(b) - 1)]

    def tied_head(self, part, table) -> list[Layer]:
        raise ValueError("model.tie_embeddings is for tp_mode 1d (tp_mode is 3d): set "
                         "tie_embeddings = false")

    def attention(self, part) -> Layer:
        return CausalSelfAttention(part.n_head // self.split.heads, part.head_dim, name=part.name)

    def embedding(self, tok, pos):
        layer = Embedding3D(self.pf, self.tp, tok.name, tok.vocab, tok.d)
        unit = Sequential([layer, PositionEmbedding3D(self.pf, self.tp, pos.name, pos.max_len,
                                                      pos.d)], name="embed")
        return unit, layer.table

    def loss(self):
        return CrossEntropy3D(self.tp)
