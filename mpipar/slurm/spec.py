"""What to run and on what: the job spec, the allocation for a grid, sweep files."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SWEEP_KEYS = ("dp", "pp", "tp", "schedule", "microbatches", "steps")
_INT_KEYS = ("dp", "pp", "tp", "microbatches", "steps")
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}
OK_STATES = {"COMPLETED"}
NO_SBATCH = ("sbatch not found: run this on a Slurm login node or use mpiexec directly "
             "(mpiexec -n N mpipar train --config ... --dp D --pp P --tp T)")


class SlurmError(ValueError):
    """A bad request (grid does not fit, bad sweep file) or a missing / failing Slurm command."""


# ---- what to run and on what -------------------------------------------------------------

@dataclass
class JobSpec:
    """One training job (or one job array when `sweep` is non-empty)."""

    config: str
    dp: int = 1
    pp: int = 1
    tp: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    steps: int | None = None
    extra_args: str = ""
    run_root: str = "runs/slurm"
    name: str = ""  # RUN_ROOT/<name> instead of RUN_ROOT/<jobid>: a resubmission finds it
    gpus_per_node: int | None = None  # set: one rank per GPU, --device cuda
    tasks_per_node: int | None = None
    nodes: int | None = None
    cpus_per_task: int = 1
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    launcher: str = "srun"
    srun_nolocal: str = "auto"  # auto | 1 | 0: MPIR_CVAR_NOLOCAL=1 under srun (PyPI mpich)
    # --signal=B:USR1@<s>: the script forwards it to the ranks, which checkpoint and exit 75
    signal_s: int = 90  # seconds before the time limit; 0: no warning signal
    requeue: bool = True  # a preempted job (exit 75 after the signal) requeues itself
    sweep: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        """Ranks the allocation must hold: the grid's, or the largest grid of the sweep."""
        if not self.sweep:
            return self.dp * self.pp * self.tp
        return max(e.get("dp", self.dp) * e.get("pp", self.pp) * e.get("tp", self.tp)
                   for e in self.sweep)


@dataclass(frozen=True)
class Allocation:
    ntasks: int
    nodes: int | None  # None: let Slurm place the tasks
    tasks_per_node: int | None


def allocation(ntasks: int, gpus_per_node: int | None = None, tasks_per_node: int | None = None,
               nodes: int | None = None) -> Allocation:
    """Nodes and tasks for `ntasks` ranks: one rank per GPU, or `tasks_per_node` ranks per node.

    Raises SlurmError when the requested nodes cannot hold the grid.
    """
    for name, value in (("ranks", ntasks), ("--gpus-per-node", gpus_per_node),
                        ("--tasks-per-node", tasks_per_node), ("--nodes", nodes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SlurmError(f"{name} must be a positive integer, got {value!r}")
    per_node = tasks_per_node
    if gpus_per_node is not None:
        if tasks_per_node is not None and tasks_per_node != gpus_per_node:
            raise SlurmError(f"GPU jobs run one rank per GPU: --tasks-per-node ({tasks_per_node}) "
                             f"must equal --gpus-per-node ({gpus_per_node}) or be left out")
        per_node = gpus_per_node
    if per_node is None:
        if nodes is not None and nodes > ntasks:
            raise SlurmError(f"--nodes {nodes} is more than the {ntasks} ranks of the grid: "
                             f"use --nodes {ntasks} or fewer")
        return Allocation(ntasks, nodes, None)
    needed = math.ceil(ntasks / per_node)
    if nodes is None:
        nodes = needed
    elif nodes * per_node < ntasks:
        unit = "GPUs" if gpus_per_node is not None else "tasks"
        raise SlurmError(f"the grid needs {ntasks} ranks but --nodes {nodes} x {per_node} {unit} "
                         f"per node gives only {nodes * per_node} tasks: use --nodes {needed} "
                         f"(or more {unit} per node, or a smaller dp*pp*tp)")
    return Allocation(ntasks, nodes, per_node)


def parse_sweep(text: str, source: str = "sweep file") -> list[dict]:
    """One grid per non-blank line: `dp=2 pp=2 tp=1 schedule=1f1b microbatches=4` ('#' comments).

    Keys left out keep the job's values. Returns one dict per line, in order (array task ids).
    """
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry: dict = {}
        for token in line.split():
            key, eq, value = token.partition("=")
            where = f"{source} line {lineno} ({raw.strip()!r})"
            if not eq or key not in SWEEP_KEYS:
                raise SlurmError(f"{where}: expected key=value with key in "
                                 f"{', '.join(SWEEP_KEYS)}, got {token!r}")
            if key in _INT_KEYS:
                if not value.isdigit() or int(value) < 1:
                    raise SlurmError(f"{where}: {key} must be a positive integer, got {value!r}")
                entry[key] = int(value)
            else:
                entry[key] = value
        entries.append(entry)
    if not entries:
        raise SlurmError(f"{source} has no grids: write one line per run, "
                         "e.g. 'dp=2 pp=2 tp=1 schedule=1f1b microbatches=4'")
    return entries


def sweep_line(entry: dict) -> str:
    return " ".join(f"{k}={entry[k]}" for k in SWEEP_KEYS if k in entry)


# ---- the script --------------------------------------------------------------------------
