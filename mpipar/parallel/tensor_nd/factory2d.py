"""The layers of the 2D (Optimus) and 2.5D (Tesseract) cuts for ``mpipar.models``'
description: every linear a SUMMA product on q x q blocks (a column and a row linear alike, each
with its bias cut by column j), LayerNorm and positions cut by column j, the token table by
(row i, column j), the loss reduced over the row."""

from __future__ import annotations

from ...nn.layers import CausalSelfAttention, Layer, Sequential
from .context import COL, ROW, TP2DContext
from .layers2d import CrossEntropy2D, Embedding2D, LayerNorm2D, Linear2D, PositionEmbedding2D


class Optimus2DLayers:
    def __init__(self, tp: TP2DContext, pf):
        self.tp, self.pf = tp, pf
        self.split = tp.split

    def norm(self, part) -> Layer:
        return LayerNorm2D(self.pf, self.tp, part.name, part.d)

    def linear(self, part) -> list[Layer]:
        """Rows of the weight by i, its last axis (output columns; q/k/v's heads) by j."""
        w, b = part.w_shape, part.b_shape
        return [Linear2D(self.pf, self.tp, part.name, part.d_in, part.d_out, bias=part.bias,
                         w_shape=w, w_split=((0, ROW), (len(w) - 1, COL)), b_shape=b,
                         b_split=((len(b) - 1, COL),))]

    def tied_head(self, part, table) -> list[Layer]:
        raise ValueError(f"model.tie_embeddings is for tp_mode 1d (tp_mode is {self.tp.mode}): "
                         f"set tie_embeddings = false")

    def attention(self, part) -> Layer:
        return CausalSelfAttention(part.n_head // self.split.heads, part.head_dim, name=part.name)

    def embedding(self, tok, pos):
        layer = Embedding2D(self.pf, self.tp, tok.name, tok.vocab, tok.d)
        unit = Sequential([layer, PositionEmbedding2D(self.pf, self.tp, pos.name, pos.max_len,
                                                      pos.d)], name="embed")
        return unit, layer.table

    def loss(self):
        return CrossEntropy2D(self.tp)
