"""A run's pipeline from its settings (``parallel.*``), with no MPI and no model: the lowered,
checked schedule, a continuous run's lists of any length, the evaluation schedule and the cut of
the units into chunks. ``training.resolved`` calls these once per run; analysis rebuilds a
dumped run's pipeline with them.
"""

from __future__ import annotations

from functools import lru_cache

from .actions import Schedule, ScheduleError
from .check import check_schedule
from .generators import build_schedule, forward_only
from .lowering import lower


def _checked(s: Schedule) -> Schedule:
    s = lower(s)
    check_schedule(s)
    return s


def _from_file(p) -> Schedule:
    if p.schedule_file.endswith(".csv"):  # torch.distributed.pipelining's schedule CSV
        from .torch_csv import load_torch_csv

        s = load_torch_csv(p.schedule_file)
    else:
        s = Schedule.load(p.schedule_file)
    if (s.pp, s.microbatches) != (p.pp, p.microbatches):
        raise ScheduleError(f"schedule file {p.schedule_file} is for pp={s.pp}, microbatches="
                            f"{s.microbatches}; the run has pp={p.pp}, microbatches="
                            f"{p.microbatches}")
    return s


def run_schedule(p, train_steps: int) -> Schedule:
    """The schedule of a run with parallel settings ``p`` and ``train_steps`` steps: read from
    ``p.schedule_file`` or generated; lowered and checked. A continuous run's is a few steps of
    its lists (its placement, versions and checks); each run between drains is ``segment``."""
    if p.schedule_file:
        s = _from_file(p)
    elif p.continuous:
        steps = min(train_steps, 2 + -(-p.pp // p.microbatches))
        s = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages, steps=steps,
                           vertical_sync=p.vertical_sync)
    else:
        s = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages,
                           vertical_sync=p.vertical_sync)
    return _checked(s)


@lru_cache(maxsize=8)
def segment(kind: str, pp: int, microbatches: int, steps: int,
            vertical_sync: bool = False) -> Schedule:
    """A continuous run's lists for ``steps`` steps between two drains, lowered and checked.
    Cached: the lengths recur (the drain interval, the rest at the end), and building and
    checking is linear in the steps (~0.1 s per step at pp = m = 8)."""
    return _checked(build_schedule(kind, pp, microbatches, steps=steps,
                                   vertical_sync=vertical_sync))


def eval_schedule(s: Schedule) -> Schedule:
    """The forward-only schedule (evaluation) on ``s``'s chunks and placement, lowered.
    ``check_schedule`` wants every backward, so it has none to pass; ``generators.forward_only``
    says why it cannot deadlock."""
    return lower(forward_only(s.pp, s.microbatches, s.virtual_stages, s.placement))
