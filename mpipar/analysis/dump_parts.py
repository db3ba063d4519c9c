"""Reading the rank parts of a schema-2 dump (an index ``trace.h5`` and ``trace.parts/``).

Each part is opened only while its rows are read (a 1,024-rank run has 1,024 parts; none is
held open). A part that is missing, or left by another run (its ``run_id`` differs from the
index's), reads as a rank with no events, named in a note: the other ranks' parts are whole
whatever happened to one (docs/dump_schema.md).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import numpy as np

from ..trace_parts import part_name


def _decode(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def grid_coords(grid: dict, world: int) -> np.ndarray:
    """(world, 3) dp, pp, tp of every world rank from the grid's ``order`` (axes fastest
    first, e.g. ``tp-dp-pp``): the coordinates of a rank whose part is missing."""
    order = str(grid.get("order") or "tp-dp-pp").split("-")
    out = np.zeros((world, 3), dtype=int)
    col = {"dp": 0, "pp": 1, "tp": 2}
    for r in range(world):
        rest = r
        for axis in order:
            size = int(grid[axis])
            out[r, col[axis]] = rest % size
            rest //= size
    return out


@contextmanager
def _events_of(path):
    import h5py

    with h5py.File(path, "r", locking=False) as f:
        yield f["events"]


@contextmanager
def _nothing():
    yield None


def part_sources(path, attrs: dict, grid: dict, world: int, error):
    """(sources, coords, rank attributes, metrics or None, all parts complete, notes).

    ``sources[r]``: (opener, committed rows, name) with ``opener()`` a context manager that
    yields the part's events dataset (None for a missing part). ``error``: the loader's
    ``DumpError`` maker, ``error(message)``."""
    import h5py

    folder = os.path.join(os.path.dirname(os.path.abspath(path)), str(attrs.get("parts", "")))
    run_id = str(attrs.get("run_id", ""))
    coords, missing, complete = grid_coords(grid, world), [], True
    sources, rank_attrs, metrics = [], [], None
    for r in range(world):
        p = os.path.join(folder, part_name(r))
        try:
            f = h5py.File(p, "r", locking=False)
        except OSError:
            missing.append(r)
            sources.append((_nothing, 0, p))
            rank_attrs.append({})
            continue
        with f:
            a = {k: _decode(v) for k, v in f.attrs.items()}
            if str(a.get("run_id", "")) != run_id:
                missing.append(r)
                sources.append((_nothing, 0, p))
                rank_attrs.append({})
                continue
            try:
                done = json.loads(a["committed"])
                n, n_m = int(done["events"]), int(done["metrics"])
                coords[r] = [int(a["dp"]), int(a["pp"]), int(a["tp"])]
            except (KeyError, TypeError, ValueError, json.JSONDecodeError):
                raise error(f"{p}: part of rank {r} has no valid 'committed', 'dp', 'pp', "
                            "'tp' attributes") from None
            if "events" not in f or f["events"].shape[0] < n:
                raise error(f"{p}: part of rank {r} holds fewer event rows than its "
                            f"'committed' count {n}: the file was cut short")
            if r == 0 and "metrics" in f and n_m:
                metrics = f["metrics"][:n_m]
            complete &= bool(a.get("complete", False))
        sources.append((lambda p=p: _events_of(p), n, p))
        rank_attrs.append(a)
    notes = []
    if missing:
        notes.append(f"ranks {missing} have no part of this run in {folder} (they never "
                     "flushed, or crashed first): analysed without their events")
    return sources, coords, rank_attrs, metrics, complete and not missing, notes
