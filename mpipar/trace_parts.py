"""The timing dump as one part per rank plus a small index (docs/dump_schema.md, version 2).

Every rank writes its own part, ``RUN_DIR/trace.parts/rank-<r>.h5``: the first flush creates
it atomically, later ones append, each committing its rows (``committed``) only after they are
written. Nothing is gathered, so a flush costs a rank its own rows and never waits for another
rank; a rank that dies loses nothing before its last flush, and the other ranks' parts are
whole. World rank 0 writes the index, ``RUN_DIR/trace.h5``: the run's attributes (config, grid,
world size, versions) and a ``run_id`` that every part repeats, so a part left by an older run
in the same directory is never read as this run's.

A leaf module like ``mpipar.trace`` (h5py only, imported inside the functions): the agreement
on the run id at the first flush is the caller's (``mpipar.mpi.job.dump``).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .files import atomic_h5

SCHEMA_VERSION = 2  # the index and its parts; schema 1 is the single gathered file

# rows per HDF5 chunk (64 B a row: 64 KiB). A part is written uncompressed while its run appends
# to it: appending to a compressed chunk moves the chunk, and a writer killed then left the rows
# already committed unreadable (tests/test_analysis_scale.py kills writers); an uncompressed
# chunk is rewritten in place with the same bytes. A finished part is rewritten once, atomically,
# with byte shuffle + gzip level 1 (about 5x smaller: the kind field is mostly padding), which
# any HDF5 tool reads.
EVENT_CHUNK, METRICS_CHUNK = 1024, 256
FILTER = {"compression": "gzip", "compression_opts": 1, "shuffle": True}


def parts_dir(path) -> str:
    """``RUN_DIR/trace.h5`` -> ``RUN_DIR/trace.parts``."""
    return os.path.splitext(os.fspath(path))[0] + ".parts"


def part_name(rank: int) -> str:
    return f"rank-{int(rank):05d}.h5"


def part_path(path, rank: int) -> str:
    return os.path.join(parts_dir(path), part_name(rank))


def _attr(value):
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return "" if value is None else value


def _set(obj, attrs: dict) -> None:
    for key, value in attrs.items():
        if key not in ("schema_version", "committed", "run_id"):
            obj.attrs[key] = _attr(value)


def write_index(path, file_attrs: dict, world: int, run_id: str) -> None:
    """The index ``path`` (atomic; replaces any older dump there, old-layout ones included)."""
    with atomic_h5(path) as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        _set(f, file_attrs)
        f.attrs["world_size"] = int(world)
        f.attrs["run_id"] = run_id
        f.attrs["parts"] = os.path.basename(parts_dir(path))


def update_index(path, file_attrs: dict) -> None:
    """Set the index's attributes (``complete`` at the end); its parts are untouched."""
    import h5py

    with h5py.File(path, "r+", locking=False) as f:
        _set(f, file_attrs)


def index_run_id(path) -> str | None:
    """The run id of the index at ``path``; None when there is none (or an old-layout file)."""
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            v = f.attrs.get("run_id")
            return v.decode() if isinstance(v, bytes) else (str(v) if v is not None else None)
    except (OSError, KeyError):
        return None


def _committed(events: int, metrics: int) -> str:
    return json.dumps({"events": int(events), "metrics": int(metrics)})


def write_part(path, rank: int, run_id: str, events, attrs: dict, metrics,
               complete: bool = False) -> None:
    """Create rank ``rank``'s part atomically with its first rows (``metrics``: rows of
    ``trace.METRICS_DTYPE``, empty on every rank but 0)."""
    os.makedirs(parts_dir(path), exist_ok=True)
    m = np.asarray(metrics)
    with atomic_h5(part_path(path, rank)) as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["run_id"] = run_id
        f.attrs["rank"] = int(rank)
        _set(f, attrs)
        _datasets(f, events, m, compress=False)
        f.attrs["committed"] = _committed(len(events), len(m))
        f.attrs["complete"] = False
    if complete:
        _rewrite(path, rank, compress=True)


def _datasets(f, events, metrics, compress: bool) -> None:
    extra = FILTER if compress else {}
    f.create_dataset("events", data=events, maxshape=(None,), chunks=(EVENT_CHUNK,), **extra)
    f.create_dataset("metrics", data=metrics, maxshape=(None,), chunks=(METRICS_CHUNK,), **extra)


def _rewrite(path, rank: int, compress: bool) -> None:
    """Rewrite rank ``rank``'s part with only its committed rows, compressed (a finished part)
    or not (one a resumed run appends to again), atomically: a crash leaves the old file."""
    import h5py

    p = part_path(path, rank)
    with h5py.File(p, "r", locking=False) as src:
        done = json.loads(src.attrs["committed"])
        attrs = dict(src.attrs)
        events, metrics = src["events"][: done["events"]], src["metrics"][: done["metrics"]]
    with atomic_h5(p) as f:
        _datasets(f, events, metrics, compress)
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["complete"] = compress  # a finished part is the compressed one


def append_part(path, rank: int, events, attrs: dict, metrics,
                complete: bool = False) -> None:
    """Append rows to rank ``rank``'s part: rows first (flushed), then ``committed``; a flush
    cut short leaves rows readers ignore and the next flush overwrites. ``complete``: the run's
    last flush, after which the part is rewritten compressed and marked complete."""
    import h5py

    m = np.asarray(metrics)
    with h5py.File(part_path(path, rank), "r", locking=False) as f:
        compressed = f["events"].compression is not None
    if compressed:  # finished once, now resumed: appends go to an uncompressed part again
        _rewrite(path, rank, compress=False)
    with h5py.File(part_path(path, rank), "r+", locking=False) as f:
        done = json.loads(f.attrs["committed"])
        n_ev = append_rows(f["events"], done["events"], events)
        n_m = append_rows(f["metrics"], done["metrics"], m)
        f.flush()  # the rows reach the file before the count that makes them visible
        f.attrs["committed"] = _committed(n_ev, n_m)
        f.flush()
        _set(f, attrs)
    if complete:
        _rewrite(path, rank, compress=True)


def append_rows(ds, committed: int, rows) -> int:
    """Write ``rows`` after the first ``committed`` rows of ``ds`` (over any uncommitted tail a
    failed flush left); return the new committed count."""
    end = committed + len(rows)
    if end > ds.shape[0]:
        ds.resize((end,))
    if len(rows):
        ds[committed:end] = rows
    return end


def rewind_parts(path, step: int, world: int) -> bool:
    """Keep each part's committed rows of the steps before ``step`` (a resumed run does the
    later ones again) and mark the index and the parts incomplete. False when ``path`` is no
    index of ``world`` ranks (the resumed run then starts a new dump)."""
    import h5py

    try:
        with h5py.File(path, "r+", locking=False) as f:
            if int(f.attrs.get("schema_version", 0)) != SCHEMA_VERSION or \
                    int(f.attrs.get("world_size", -1)) != world:
                return False
            f.attrs["complete"] = False
        for r in range(world):
            p = part_path(path, r)
            if not os.path.isfile(p):
                continue  # that rank never flushed: its first flush writes the part
            with h5py.File(p, "r+", locking=False) as f:
                done = json.loads(f.attrs["committed"])
                f.attrs["committed"] = _committed(
                    rows_before(f["events"], done["events"], step),
                    rows_before(f["metrics"], done["metrics"], step))
                f.attrs["complete"] = False
    except (OSError, KeyError, ValueError):
        return False
    return True


def rows_before(ds, committed: int, step: int) -> int:
    """How many of the first ``committed`` rows come before the first row of ``step`` or later
    (rows are in time order; set-up rows carry step -1)."""
    steps = np.asarray(ds.fields("step")[:committed])
    later = np.flatnonzero(steps >= step)
    return int(later[0]) if later.size else int(committed)
