"""Where the pipeline cuts the model: {chunk: (first unit, end unit)}, from the config alone.

One function for the trainer (which builds the chunks it names) and the memory model (which
predicts what they hold): ``parallel.layout`` when given (Megatron's "Et*3|t*3L" form, or
"auto": ``balance.auto_bounds``), else
``parallel.partition`` (uniform, params and cost weigh each unit by its full parameter count
from the model description, explicit takes ``parallel.boundaries``).
"""

from __future__ import annotations

from ..parallel.pipeline.partition import chunk_layers
from ..parallel.pipeline.stage_layout import layout_bounds
from .balance import auto_bounds
from .counts import gpt_counts, mlp_unit_params
from .spec import GPTDims


def unit_count(mcfg) -> int:
    """How many pipeline units ``build_model`` makes: GPT: the embedding, ``n_layer`` blocks,
    the head; MLP: one per linear."""
    if mcfg.kind == "gpt":
        return mcfg.n_layer + 2
    return len(mcfg.sizes) - 1


def unit_weights(mcfg) -> list[int]:
    """Each unit's full parameter count plus one (so weightless units still cost something)."""
    if mcfg.kind == "gpt":
        return [u.params_full + 1 for u in gpt_counts(GPTDims.of(mcfg))]
    return [n + 1 for n in mlp_unit_params(list(mcfg.sizes))]


def stage_bounds(mcfg, pcfg, pp: int, virtual_stages: int = 1) -> dict[int, tuple[int, int]]:
    """{chunk: (first unit, end unit)}; chunk c runs on pipeline rank c % pp (``mcfg``: a
    ``ModelConfig``, ``pcfg``: a ``ParallelConfig``; raises the partitioner's or the layout's
    error when they do not fit)."""
    if pcfg.layout == "auto":  # balanced by the description's cost (``balance``)
        return auto_bounds(mcfg, pp, virtual_stages)
    if pcfg.layout:
        return layout_bounds(pcfg.layout, mcfg.n_layer, pp * virtual_stages)
    kw = {"method": pcfg.partition}
    if pcfg.partition in ("params", "cost"):
        kw["weights"] = unit_weights(mcfg)
    if pcfg.partition == "explicit":
        kw["boundaries"] = list(pcfg.boundaries)
    return chunk_layers(unit_count(mcfg), pp, virtual_stages, **kw)
