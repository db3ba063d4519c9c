"""Training: config -> grid -> model shard -> schedule -> optimizer -> tracer.

``preflight`` validates a config against the world and the model and resolves the run once
(``resolved.ResolvedRun``: the lowered schedule, micro-batches, mode, stage cut); ``Trainer``
runs one step on this rank, through the step class of the run's mode (``steps``); ``run`` is
the whole run (``mpipar train``). Each step: the global batch (deterministic from seed and
step) is cut into this replica's rows and into micro-batches (``batches``); the pipeline
executor runs this rank's action list and reports gradients to the data-parallel ``GradSync``
(tp partial sums, then dp buckets); the global gradient norm is clipped; the optimizer steps.
"""

from .batches import Batches, local_microbatches, split_rows
from .loop import prepare_data, run
from .optimizers import ChunkOptimizers, make_optimizer, step_lr
from .preflight import check_model, preflight
from .resolved import ResolvedRun, resolve, stage_bounds
from .trainer import Trainer

__all__ = [
    "Batches", "ChunkOptimizers", "ResolvedRun", "Trainer", "check_model", "local_microbatches",
    "make_optimizer", "preflight", "prepare_data", "resolve", "run", "split_rows",
    "stage_bounds", "step_lr",
]
