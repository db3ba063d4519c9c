"""The MLP: linears ``sizes[0] -> ... -> sizes[-1]``, one pipeline unit each, 1d tp only."""

from __future__ import annotations

from ..nn.layers import GELU, Bias, Layer, Linear, ParamFactory, ReLU, Sequential
from ..nn.losses import CrossEntropyLoss, MSELoss
from ..nn.params import ShardSpec
from ..parallel.tensor import TPContext
from .model import Model, full_size


def check_mlp_shapes(mcfg, tp_size=1):
    """With tp > 1 every column-parallel width (sizes[1], sizes[3], ...) must divide by tp."""
    n = len(mcfg.sizes) - 1
    if tp_size == 1:
        return
    for i in range(0, n - 1, 2):
        if mcfg.sizes[i + 1] % tp_size:
            raise ValueError(f"model.sizes[{i + 1}] = {mcfg.sizes[i + 1]} is split over tp = "
                             f"{tp_size} (column-parallel) and must divide by it")


def build_mlp(mcfg, backend, seed=0, tp: TPContext | None = None) -> Model:
    """Linears ``sizes[0] -> sizes[1] -> ... -> sizes[-1]`` with an activation between them.

    With tp > 1 consecutive linears pair up as Megatron's MLP (column-parallel then row-parallel,
    the activation between them local to each rank); an odd last linear is replicated.
    Each linear (with what follows it) is one pipeline unit.
    """
    tp = tp or TPContext()
    check_mlp_shapes(mcfg, tp.size)
    sizes = list(mcfg.sizes)
    n = len(sizes) - 1
    pf = ParamFactory(backend, seed=seed, tp_rank=tp.rank, tp_size=tp.size, std=mcfg.init_std)
    act_cls = {"relu": ReLU, "gelu": GELU}[mcfg.activation]
    units, widths = [], []
    for i in range(n):
        name = f"layers.{i}"
        paired = tp.size > 1 and (i % 2 == 0 and i + 1 < n or i % 2 == 1)
        parts: list[Layer] = []
        widths.append(sizes[i + 1] // (tp.size if paired and i % 2 == 0 else 1))
        if paired and i % 2 == 0:
            parts += [tp.enter(f"{name}.f"),
                      Linear(pf, name, sizes[i], sizes[i + 1], w_spec=tp.col,
                             b_spec=ShardSpec(axis=0))]
        elif paired:
            parts += [Linear(pf, name, sizes[i], sizes[i + 1], bias=False, w_spec=tp.row),
                      tp.leave(f"{name}.g"), Bias(pf, name, sizes[i + 1])]
        else:
            parts.append(Linear(pf, name, sizes[i], sizes[i + 1]))
        if i < n - 1:
            parts.append(act_cls(f"{name}.act"))
        units.append(Sequential(parts, name=name))
    if mcfg.task == "classification":
        loss = CrossEntropyLoss()  # logits are replicated over tp: each rank has them all
    else:
        loss = MSELoss()
    model = Model("mlp", units, loss, out_widths=widths)
    model.n_params_full = full_size(model.params())
    return model
