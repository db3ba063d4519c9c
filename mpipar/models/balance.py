"""``parallel.layout = "auto"``: stages balanced by each unit's cost, counted from the model
description, the head, the loss and the embedding included.

A uniform cut counts blocks; the last stage then also carries the head's GEMM and the loss (a
softmax over the vocabulary), the first the embedding, and a pipeline kept full across steps
turns the difference into steady idle on the other stages. Here a unit's cost per token is its
forward and backward FLOPs (3x the forward's: ``counts.part_flops``) plus ``ELEMENTWISE``
FLOPs for each value it keeps or works on per token (``counts.UnitCounts``: stored, work; the
embedding's lookup and scatter-add, the loss's softmax and gradient). The cut is the min-max
contiguous split of ``partition`` (the one ``parallel.partition = cost`` and
``mpipar schedule --layout-from DUMP`` use), for any schedule's number of chunks.
"""

from __future__ import annotations

from ..parallel.pipeline.partition import chunk_layers
from ..parallel.pipeline.stage_layout import layout_string
from .counts import gpt_counts
from .spec import GPTDims

# FLOPs one memory-bound value (read, written once or twice) costs against a GEMM's FLOP: the
# order of a CPU core's or a GPU's FLOP rate over its memory bandwidth in values
ELEMENTWISE = 8


def unit_costs(mcfg) -> list[float]:
    """Cost per token (or sample, MLP) of each pipeline unit, forward and backward."""
    if mcfg.kind == "gpt":
        return [3.0 * u.flops + ELEMENTWISE * (u.stored + u.work)
                for u in gpt_counts(GPTDims.of(mcfg))]
    sizes = list(mcfg.sizes)
    costs = [3.0 * 2 * a * o + ELEMENTWISE * 2 * o for a, o in zip(sizes[:-1], sizes[1:])]
    costs[-1] += ELEMENTWISE * 2 * sizes[-1]  # the loss: its softmax and gradient
    return costs


def auto_bounds(mcfg, pp: int, virtual_stages: int = 1) -> dict[int, tuple[int, int]]:
    """{chunk: (first unit, end unit)} balancing ``unit_costs`` over pp * virtual_stages."""
    return chunk_layers(len(unit_costs(mcfg)), pp, virtual_stages, method="cost",
                        weights=unit_costs(mcfg))


def describe(mcfg, bounds: dict[int, tuple[int, int]]) -> str:
    """The cut as a run can be given it again: a GPT's Megatron layout (E, t*N, L, '|'),
    an MLP's first unit of each stage (``parallel.boundaries``)."""
    if mcfg.kind != "gpt":
        return "boundaries " + ",".join(str(lo) for _, (lo, _) in sorted(bounds.items()))
    return layout_string(["E"] + ["t"] * mcfg.n_layer + ["L"], bounds)
