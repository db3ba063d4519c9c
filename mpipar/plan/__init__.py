"""``mpipar plan``: predict a GPT training step at cluster scale and rank the configurations.

Layers: ``model`` (shape, FLOP count), ``cluster`` (hardware specs, bundled TOML), ``costs`` (one
layer on one GPU), ``pipeline`` (schedule timing from mpipar's schedules), ``evaluate`` (one
configuration), ``search`` (enumerate and rank), ``sc21`` (the published validation table).
No MPI, no training code: pure arithmetic on the specs.
"""

from .cluster import Cluster, bundled, load_cluster
from .errors import PlanError
from .evaluate import Config, evaluate, executed_flops
from .model import PRESETS, GPTShape, load_model, megatron_sc21_flops
from .search import describe, parse_fix, plan

__all__ = [
    "PRESETS", "Cluster", "Config", "GPTShape", "PlanError", "bundled", "describe", "evaluate",
    "executed_flops", "load_cluster", "load_model", "megatron_sc21_flops", "parse_fix", "plan",
]
