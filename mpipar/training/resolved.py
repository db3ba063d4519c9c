"""The run, resolved once: what every rank's trainer, batches and executor read.

``resolve(cfg)`` turns the settings into the facts a run needs, in one place: the schedule
(generated or read from a file, lowered, checked), the micro-batch count (the schedule's), the
training mode (which step class runs it), the tp mode, the cut of the model's units into
chunks and their placement on the pipeline ranks; a continuous run's lists between two drains
come from ``segment``, one function of the resolved run. ``preflight`` calls ``resolve`` before
any MPI work; nothing downstream rebuilds a schedule or reads these from the config again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..models import stage_bounds as models_stage_bounds
from ..parallel.pipeline import build
from ..parallel.pipeline.actions import Schedule

# the training modes, one step class each (``steps.STEP_CLASSES``)
MODES = ("synchronous", "pipedream", "2bw", "continuous", "continuous-2bw")


@dataclass(frozen=True)
class ResolvedRun:
    cfg: Config
    schedule: Schedule  # lowered and checked (continuous: a few steps of the lists)
    mode: str  # one of MODES
    tp_mode: str  # 1d | 2d | 2.5d | 3d
    bounds: dict  # {chunk: (first unit, end unit)}
    eval_schedule: Schedule  # forward only, on the same chunks and placement

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: the schedule's (a schedule file's equals the config's)."""
        return self.schedule.microbatches

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding global chunk ``chunk`` (the schedule's placement)."""
        return self.schedule.rank_of(chunk)

    def segment(self, steps: int) -> Schedule:
        """A continuous run's lists for ``steps`` steps between two drains (lowered, checked)."""
        s = self.schedule
        return build.segment(s.kind, s.pp, s.microbatches, steps, s.vertical_sync)


def training_mode(cfg: Config, schedule: Schedule) -> str:
    """Which step class runs the schedule (``MODES``)."""
    if cfg.parallel.continuous:  # no flush between steps either
        return "continuous-2bw" if schedule.kind == "pipedream-2bw" else "continuous"
    if schedule.asynchronous:
        return "pipedream"  # an update per micro-batch, weight stashing
    if schedule.kind == "pipedream-2bw":
        return "2bw"  # a flush per step, gradients taken one version late
    return "synchronous"


def stage_bounds(cfg: Config, virtual_stages: int) -> dict:
    """{chunk: (first unit, end unit)}: the cut ``parallel.layout`` / ``parallel.partition``
    asks for (``models.stage_bounds``, from the model description alone)."""
    return models_stage_bounds(cfg.model, cfg.parallel, cfg.parallel.pp, virtual_stages)


def resolve(cfg: Config) -> ResolvedRun:
    """The run ``cfg`` describes, resolved (module doc). Raises ValueError (ScheduleError,
    PartitionError, LayoutError) with a message saying what to change."""
    schedule = build.run_schedule(cfg.parallel, cfg.train.steps)
    return ResolvedRun(cfg=cfg, schedule=schedule, mode=training_mode(cfg, schedule),
                       tp_mode=cfg.parallel.tp_mode,
                       bounds=stage_bounds(cfg, schedule.virtual_stages),
                       eval_schedule=build.eval_schedule(schedule))
