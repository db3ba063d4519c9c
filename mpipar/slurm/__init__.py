"""Slurm batch scripts for mpipar training runs: render, submit, watch.

``spec``: the job spec, the allocation for a grid, sweep files; ``render``: the scripts;
``jobs``: sbatch / scontrol / squeue / scancel and collecting results.

One bash body serves every script: the checked-in templates slurm/train.sbatch and
slurm/sweep.sbatch (settings from the environment) and the scripts `mpipar slurm render` writes
(settings chosen on the command line, still overridable from the environment). Keeping one body
means the checked-in files cannot drift from what the CLI submits (a test compares them).

No MPI here: this package only writes text and calls sbatch / scontrol / squeue / scancel.
"""

from .jobs import (
    JobState,
    cancel,
    collect,
    error_text,
    failed_rows,
    job_states,
    remember,
    run_root_of,
    submit,
    wait,
)
from .render import render, render_static, write_static
from .spec import (
    ACTIVE_STATES,
    NO_SBATCH,
    OK_STATES,
    SWEEP_KEYS,
    Allocation,
    JobSpec,
    SlurmError,
    allocation,
    parse_sweep,
    sweep_line,
)

__all__ = [
    "ACTIVE_STATES", "NO_SBATCH", "OK_STATES", "SWEEP_KEYS", "Allocation", "JobSpec", "JobState",
    "SlurmError", "allocation", "cancel", "collect", "error_text", "failed_rows", "job_states",
    "parse_sweep", "remember", "render", "render_static", "run_root_of", "submit", "sweep_line",
    "wait", "write_static",
]
