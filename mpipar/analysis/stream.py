"""A dump read one rank at a time: each rank's events reduced at once to what ``breakdown``
reads of them, then dropped (``load``, what ``mpipar analyze`` does).

Holding every rank's events (and the per-rank pieces worked out from them) cost about 250
bytes an event at the peak: 9.7 GB for a 1,024-rank, 1,000-step dump. Here the peak is one
rank's events plus, for every rank, per-step summaries: the breakdown's per-step columns and
the means of the others (``breakdown.rank_summary``), per-kind collective totals
(``bandwidth.rank_totals``), the durations the cost model is fitted from (compute units, p2p
posts and waits, the step parts: ``fit_parts``), the measured mean costs' durations, the
events per step, and bytes per link class on several hosts.

Each piece is made by the same function that makes it from a whole run (on a run whose only
events are this rank's), so the numbers are the same. What stays of a rank's events (its
residue, ``Run.events``): the ``mem.*`` markers (``predict.measured_memory``), the rows of the
steps the p2p latency is timed on (``costmodel.latency_steps``: the matching of sends and
receives reads a step's events), and the first row (so a rank with events is told from one
without). A piece asked for that the pass did not make is an error, never a guess
(``fit_parts.cached``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import kinds
from .fit_parts import cached, step_p2p, step_parts
from .flops import setting as get
from .index import KEEP_LAST


def _schedule(run):
    """The run's lowered schedule (as ``predict`` builds it), or None when it has none."""
    try:
        from mpipar.parallel.pipeline.generators import build_schedule
        from mpipar.parallel.pipeline.lowering import lower

        kind, m = get(run.config, "schedule"), get(run.config, "microbatches")
        v = int(get(run.config, "virtual_stages", 1) or 1)
        return lower(build_schedule(kind, int(run.grid["pp"]), int(m), virtual_stages=v))
    except Exception:  # predict says why; its pieces are then not needed
        return None


def _loaded_steps(path, sources, choice) -> tuple:
    """(the steps >= 0 of the rows ``load`` would read, the step selection or None)."""
    from .dump import _KEEP_KINDS, _step_column

    if choice is None:  # each rank's distinct steps only: a rank's column at a time
        found = set()
        for opener, n, _ in sources:
            with opener() as ds:
                if ds is not None:
                    found.update(np.unique(_step_column(ds, n)).tolist())
        return sorted(s for s in found if s >= 0), None
    cols = []
    for opener, n, _ in sources:
        with opener() as ds:
            cols.append(None if ds is None else _step_column(ds, n))
    found = np.unique(np.concatenate([c for c in cols if c is not None] or [np.empty(0, int)]))
    selection = choice.choose([int(s) for s in found if s >= 0], path)
    keep, loaded = np.asarray(selection[0]), set()
    for (opener, _, _), col in zip(sources, cols, strict=True):
        if col is None:
            continue
        with opener() as ds:
            kinds = np.asarray(ds.fields("kind")[: len(col)])
        mask = np.isin(col, keep) | np.isin(kinds, _KEEP_KINDS)
        loaded.update(int(s) for s in np.unique(col[mask]) if s >= 0)
    return sorted(loaded), selection


def _read_rank(path, source, keep):
    from .dump import EVENT_DTYPE, _select_rows, _step_column, _to_analysis

    opener, n, _ = source
    with opener() as ds:
        if ds is None:
            return np.empty(0, EVENT_DTYPE)
        if keep is None:
            return _to_analysis(ds[()] if n is None else ds[:n])
        return _to_analysis(_select_rows(ds, n, _step_column(ds, n), keep))


def load(path, name: str | None = None, steps=None, step=None):
    """``dump.load(path, name, steps)`` streamed: a ``Run`` for ``breakdown(run, step)``
    holding each rank's residue and pieces (module doc); a continuous run is read whole."""
    from . import dump

    return dump.load(path, name, steps,
                     summarise=lambda run, sources, choice: summarise(run, sources, choice, step))


def summarise(run, sources, choice, step) -> None:
    """Read ``run``'s ranks from ``sources`` one at a time into per-rank pieces in
    ``run.cache`` (keyed ("rank", r, name), see ``fit_parts.cached``) for ``breakdown(run,
    step)``; ``run.events`` becomes each rank's residue (module doc)."""
    from .bandwidth import rank_totals
    from .breakdown import rank_row
    from .costmodel import latency_steps
    from .dump import DumpError
    from .links import hosts_of, rank_link_bytes
    from .predict import events_per_step_of, rank_cost_piece
    from .steps import StepChoice
    from .units import rank_units

    loaded, selection = _loaded_steps(run.path, sources, choice)
    run.selection = selection
    if step is None and selection is not None:
        steps, notes = list(selection[0]), list(selection[1])
    else:
        steps, notes = StepChoice(step=step).choose(loaded, run.path)
    if not steps:
        raise DumpError(f"{run.path}: no measured steps")
    keep = None if selection is None else np.asarray(selection[0])
    sched = _schedule(run)
    timed = np.asarray(latency_steps(run, steps), dtype=np.int64)
    hosts = hosts_of(run)
    multi = hosts is not None and len(set(hosts)) > 1
    spans = []
    world = run.world_size
    residue = []
    for r in range(world):
        ev = _read_rank(run.path, sources[r], keep)
        kinds.codes_of(ev)  # once, on load: the pieces below read them (``kinds``)
        events = [ev[:0]] * world
        events[r] = ev
        one = replace(run, events=events, cache={KEEP_LAST: True})
        rank_row(one, r, steps)
        rank_totals(one, r, steps)
        rank_cost_piece(one, r, steps)
        events_per_step_of(one, r, steps)
        if multi:
            rank_link_bytes(one, r, steps, hosts, spans)
        if sched is not None and len(ev):
            p = int(run.coords[r, 1])
            rank_units(one, r, sched)
            n = len(sched.ranks[p]) if p < len(sched.ranks) else 1
            cached(one, r, ("step_parts", n), lambda e, n=n: step_parts(e, n))
            cached(one, r, "p2p", step_p2p)
        for key, got in one.cache.items():
            if isinstance(key, tuple) and key[1] == id(ev):
                run.cache[("rank", r, key[0])] = got[1]
        mask = np.isin(ev["step"], timed) | kinds.table(kinds.is_mem)[kinds.codes_of(ev)]
        mask[:1] = True
        residue.append(ev[mask])
        del ev, events, one
    run.events = residue
    run.cache.update(streamed=True, steps=loaded, measured=(steps, notes, step))
