"""Reading one HDF5 timing dump (docs/dump_schema.md) into a ``Run``: schema 2 (an index and one
part per rank, ``dump_parts``) and schema 1 (one file, every rank under ``/ranks``).

Only the rows the ``committed`` attributes count are read (the tail of a flush that crashed is
ignored); schema-1 dumps written before that attribute existed are read whole.

Only h5py and numpy: analysis never imports MPI. Every problem with a file (missing, not HDF5,
another schema version, a missing attribute or field) is a ``DumpError`` that names the file,
what is wrong and what to do, because the person reading it usually did not write the file.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

# The writer's on-disk layout is the contract (mpipar.trace is a leaf: no MPI in it).
from ..trace import EVENT_DTYPE as DISK_EVENT_DTYPE
from ..trace import SCHEMA_VERSION  # noqa: F401 (re-exported)
from ..trace_parts import SCHEMA_VERSION as PARTS_VERSION
from .dump_parts import part_sources
from .steps import StepError

# the fields of /ranks/<r>/events, in schema order
EVENT_FIELDS = DISK_EVENT_DTYPE.names

# analysis works with `kind` as a str (U24) so code can compare against "F" rather than b"F"
EVENT_DTYPE = np.dtype([(n, "U24" if n == "kind" else DISK_EVENT_DTYPE[n]) for n in EVENT_FIELDS])

# file attributes analysis cannot work without (the schema's others are read when present)
REQUIRED_ATTRS = ("schema_version", "config", "grid", "world_size")
JSON_ATTRS = ("config", "grid", "hostnames", "devices", "versions")
RANK_ATTRS = ("dp", "pp", "tp")

_RERUN = "re-run the training to write a new dump"


class DumpError(ValueError):
    """A timing dump that cannot be analysed; the message says which file, what and what to do."""


@dataclass
class Run:
    """One run's dump: config, grid, per-rank events and coordinates, metrics."""

    path: str
    name: str
    schema_version: int
    config: dict
    grid: dict
    world_size: int
    events: list  # events[r]: structured array (EVENT_DTYPE) of world rank r, in recording order
    coords: np.ndarray  # (world_size, 3) int array: dp, pp, tp of each world rank
    attrs: dict = field(default_factory=dict)  # all file attributes, JSON ones decoded
    rank_attrs: list = field(default_factory=list)  # attributes of /ranks/<r>, decoded
    metrics: np.ndarray | None = None  # /metrics rows, or None when the run wrote none
    complete: bool = False  # False: the run crashed or the dump is a mid-run flush
    # (steps, notes) when loaded with a step choice (``load(steps=...)``): only those were read
    selection: tuple | None = None
    notes: list = field(default_factory=list)  # what the loader could not read, and why
    # derived data (``analysis.index``: events grouped by step), shared by ``replace`` copies
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def coord(self, rank: int) -> dict:
        dp, pp, tp = (int(v) for v in self.coords[rank])
        return {"dp": dp, "pp": pp, "tp": tp}

    def label(self, rank: int) -> str:
        """Row label of a rank in tables and plots: ``r3 dp1/pp0/tp1``."""
        c = self.coord(rank)
        return f"r{rank} dp{c['dp']}/pp{c['pp']}/tp{c['tp']}"

    def steps(self) -> list[int]:
        """Training steps (>= 0) that have events on any rank, sorted."""
        if "steps" in self.cache:  # a streamed run: its events are gone (``analysis.stream``)
            return list(self.cache["steps"])
        found = set()
        for ev in self.events:
            found.update(int(s) for s in np.unique(ev["step"]) if s >= 0)
        return sorted(found)

    @property
    def peak_flops(self) -> float | None:
        """The ``peak_flops`` attribute (FLOP/s of one device, a measured GEMM peak) or None."""
        v = self.attrs.get("peak_flops")
        if v is None or v == "":
            return None
        try:
            v = float(v)
        except (TypeError, ValueError):
            return None
        return v if v > 0 else None


def _decode(value):
    """h5py returns str, bytes, numpy scalars or 0-d arrays depending on how it was written."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _run_name(path: str) -> str:
    """``sweep/pp2/trace.h5`` -> ``pp2``; ``foo.h5`` -> ``foo``."""
    base = os.path.basename(path)
    if base == "trace.h5":
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
        return parent or "trace"
    return os.path.splitext(base)[0]


def load(path, name: str | None = None, steps=None, summarise=None) -> Run:
    """Read and validate the dump at ``path``; ``DumpError`` (with the fix) when it is unusable.

    ``steps``: a ``steps.StepChoice`` (or None: every row). With one, only the rows of the
    chosen steps are read (and the set-up rows, step < 0, and the ``mem.static``/``mem.base``
    markers the memory measurement needs), and ``Run.selection`` says which and why.
    ``summarise(run, sources, choice)``: reads the ranks itself (``stream.load``)."""
    import h5py

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(
            f"{path}: no such file; pass the trace.h5 a run wrote (RUN_DIR/trace.h5) or its "
            "directory"
        )
    if os.path.isdir(path):
        raise DumpError(
            f"{path}: is a directory; pass RUN_DIR/trace.h5 (`mpipar analyze` globs directories)"
        )
    try:
        f = h5py.File(path, "r", rdcc_nbytes=0)  # no chunk cache: rows are read once
    except OSError as exc:
        raise DumpError(f"{path}: not a readable HDF5 file ({exc}); {_RERUN}") from None
    try:
        with f:
            return _load_open(path, f, name, steps, summarise)
    except (DumpError, StepError):
        raise
    except (UnicodeDecodeError, OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:
        # a damaged file (e.g. flipped bits) fails deep inside h5py or a decode
        raise DumpError(f"{path}: damaged timing dump, cannot read it ({type(exc).__name__}: "
                        f"{exc}); {_RERUN}") from None


def _load_open(path, f, name, choice=None, summarise=None) -> Run:
    attrs = {k: _decode(v) for k, v in f.attrs.items()}
    _check_version(path, attrs)
    for key in REQUIRED_ATTRS:
        if key not in attrs:
            raise DumpError(
                f"{path}: file attribute '{key}' is missing (docs/dump_schema.md requires it); "
                f"the writer is incomplete or the file was cut short: {_RERUN}"
            )
    for key in JSON_ATTRS:
        if key in attrs and isinstance(attrs[key], str):
            try:
                attrs[key] = json.loads(attrs[key]) if attrs[key] else None
            except json.JSONDecodeError as exc:
                raise DumpError(
                    f"{path}: file attribute '{key}' is not valid JSON ({exc}); {_RERUN}"
                ) from None
    config, grid = attrs["config"], attrs["grid"]
    if not isinstance(config, dict):
        raise DumpError(
            f"{path}: attribute 'config' must be a JSON object, got {type(config).__name__}"
        )
    grid = _check_grid(path, grid, attrs["world_size"])
    world = int(attrs["world_size"])
    notes, metrics = [], None
    if int(attrs["schema_version"]) >= PARTS_VERSION:
        sources, coords, rank_attrs, metrics, parts_complete, notes = part_sources(
            path, attrs, grid, world, lambda msg: DumpError(f"{msg}; {_RERUN}"))
        attrs["complete"] = bool(attrs.get("complete", False)) and parts_complete
        attrs["hostnames"] = [a.get("hostname", "") for a in rank_attrs]
        attrs["devices"] = [a.get("device", "cpu") for a in rank_attrs]
    else:
        committed = _committed(path, attrs, world)
        sources, coords, rank_attrs = _rank_sources(path, f, world, committed)
        if "metrics" in f:
            metrics = _rows(path, f["metrics"], committed, "metrics")
    from .flops import setting  # a continuous run is read whole (predict_continuous)
    stream = summarise is not None and not setting(config, "continuous", False)
    events, selection = ([], None) if stream else _read_events(path, sources, choice)
    if metrics is not None and not len(metrics):
        metrics = None
    run = Run(
        path=path,
        name=name or _run_name(path),
        schema_version=int(attrs["schema_version"]),
        config=config,
        grid=grid,
        world_size=world,
        events=events,
        coords=coords,
        attrs=attrs,
        rank_attrs=rank_attrs,
        metrics=metrics,
        complete=bool(attrs.get("complete", False)),
        selection=selection,
        notes=notes,
    )
    if stream:  # each rank read, summarised and dropped
        summarise(run, sources, choice)
    return run


def _read_events(path, sources, choice):
    """(events per rank as analysis's dtype, the step selection or None). ``sources[r]``:
    (opener, committed rows or None, name), ``opener()`` yielding the dataset (None: no part).
    With a ``choice``, the step column of every rank is read first, then only the chosen rows."""
    def each(fn):
        out = []
        for opener, n, _ in sources:
            with opener() as ds:
                out.append(fn(ds, n) if ds is not None else None)
        return out

    if choice is None:
        raw = each(lambda ds, n: _to_analysis(ds[()] if n is None else ds[:n]))
        return [np.empty(0, EVENT_DTYPE) if e is None else e for e in raw], None
    cols = each(_step_column)
    found = np.unique(np.concatenate([c for c in cols if c is not None] or [np.empty(0, int)]))
    selection = choice.choose([int(s) for s in found if s >= 0], path)
    keep = np.asarray(selection[0])
    events = []
    for (opener, n, _), col in zip(sources, cols, strict=True):
        with opener() as ds:
            events.append(np.empty(0, EVENT_DTYPE) if ds is None
                          else _to_analysis(_select_rows(ds, n, col, keep)))
    return events, selection


def _check_version(path, attrs) -> None:
    if "schema_version" not in attrs:
        raise DumpError(
            f"{path}: file attribute 'schema_version' is missing, so this is not an mpipar "
            "timing dump "
            f"(or one written before versioning); {_RERUN}"
        )
    try:
        version = int(attrs["schema_version"])
    except (TypeError, ValueError):
        raise DumpError(
            f"{path}: schema_version {attrs['schema_version']!r} is not an integer"
        ) from None
    if version < SCHEMA_VERSION:
        raise DumpError(
            f"{path}: dump schema_version {version} is older than the versions "
            f"{SCHEMA_VERSION}-{PARTS_VERSION} this "
            f"mpipar reads; analyse it with the mpipar that wrote it, or {_RERUN}"
        )
    if version > PARTS_VERSION:
        raise DumpError(
            f"{path}: dump schema_version {version} is newer than the versions "
            f"{SCHEMA_VERSION}-{PARTS_VERSION} this "
            f"mpipar reads; upgrade mpipar (pip install -e . in a newer checkout)"
        )


def _check_grid(path, grid, world) -> dict:
    if not isinstance(grid, dict):
        raise DumpError(
            f'{path}: attribute \'grid\' must be a JSON object like {{"dp":1,"pp":2,"tp":1}}'
        )
    for axis in RANK_ATTRS:
        if axis not in grid:
            raise DumpError(
                f"{path}: attribute 'grid' has no field '{axis}' (got {grid}); {_RERUN}"
            )
    size = int(grid["dp"]) * int(grid["pp"]) * int(grid["tp"])
    if size != int(world):
        raise DumpError(
            f"{path}: grid {grid} has {size} ranks but world_size is {world}; "
            "the dump is inconsistent"
        )
    return grid


def _committed(path, attrs, world) -> dict | None:
    """The row counts the writer committed (``committed``, JSON); None in older dumps."""
    if "committed" not in attrs:
        return None
    try:
        c = json.loads(attrs["committed"])
        events = [int(n) for n in c["events"]]
        c = {"events": events, "metrics": int(c["metrics"])}
    except (TypeError, ValueError, KeyError, json.JSONDecodeError):
        raise DumpError(f"{path}: file attribute 'committed' is not valid "
                        f"({attrs['committed']!r}); {_RERUN}") from None
    if len(events) != world:
        raise DumpError(f"{path}: attribute 'committed' lists {len(events)} ranks but "
                        f"world_size is {world}; {_RERUN}")
    return c


def _rows(path, ds, committed, what, rank=None):
    """The committed rows of a dataset: rows past the count are a flush that did not finish."""
    if committed is None:
        return ds[()]
    n = committed["metrics"] if rank is None else committed["events"][rank]
    if n > ds.shape[0]:
        raise DumpError(f"{path}: '{what}' holds {ds.shape[0]} rows but {n} are committed: "
                        f"the file was cut short; {_RERUN}")
    return ds[:n]


def _rank_sources(path, f, world, committed=None):
    """([(opener, committed rows or None, name)], coords, rank attributes) of a schema-1 file
    (``/ranks/<r>/events``), checked field by field, no rows read yet; ``opener()`` yields the
    dataset."""
    if "ranks" not in f:
        raise DumpError(f"{path}: group '/ranks' is missing (no events were written); {_RERUN}")
    sources, coords, rank_attrs = [], np.zeros((world, 3), dtype=int), []
    for r in range(world):
        key = str(r)
        if key not in f["ranks"]:
            raise DumpError(
                f"{path}: group '/ranks/{r}' is missing (world_size is {world}); "
                "the dump was cut short "
                f"or written by a rank subset: {_RERUN}"
            )
        g = f["ranks"][key]
        if "events" not in g:
            raise DumpError(f"{path}: dataset '/ranks/{r}/events' is missing; {_RERUN}")
        ds = g["events"]
        where = f"{path}: dataset '/ranks/{r}/events'"
        _check_fields(ds, where)
        n = committed["events"][r] if committed is not None else None
        if n is not None and n > ds.shape[0]:
            raise DumpError(f"{path}: '/ranks/{r}/events' holds {ds.shape[0]} rows but {n} are "
                            f"committed: the file was cut short; {_RERUN}")
        sources.append((lambda ds=ds: nullcontext(ds), n, where))
        a = {k: _decode(v) for k, v in g.attrs.items()}
        for axis in RANK_ATTRS:
            if axis not in a:
                raise DumpError(f"{path}: attribute '{axis}' of '/ranks/{r}' is missing; {_RERUN}")
        coords[r] = [int(a["dp"]), int(a["pp"]), int(a["tp"])]
        rank_attrs.append(a)
    return sources, coords, rank_attrs


def _check_fields(ds, where) -> None:
    names = ds.dtype.names or ()
    for name in EVENT_FIELDS:
        if name not in names:
            raise DumpError(f"{where} has no field '{name}' (fields: {list(names)}); the dump "
                            f"does not follow docs/dump_schema.md: {_RERUN}")


def _step_column(ds, n) -> np.ndarray:
    return np.asarray(ds.fields("step")[: ds.shape[0] if n is None else n])


# set-up markers the memory measurement needs whatever steps are chosen (analysis.predict)
_KEEP_KINDS = (b"mem.static", b"mem.base")


def _select_rows(ds, n, steps_col, keep) -> np.ndarray:
    """The rows of the ``keep`` steps, of set-up (step < 0) and ``_KEEP_KINDS``, read as the
    contiguous ranges they form (a step's rows are recorded together)."""
    n = ds.shape[0] if n is None else n
    mask = np.isin(steps_col, keep) | (steps_col < 0)
    mask |= np.isin(np.asarray(ds.fields("kind")[:n]), _KEEP_KINDS)
    idx = np.flatnonzero(mask)
    if not idx.size:
        return ds[:0]
    cut = np.flatnonzero(np.diff(idx) > 1) + 1
    ranges = zip(np.r_[idx[0], idx[cut]], np.r_[idx[cut - 1], idx[-1]] + 1, strict=True)
    return np.concatenate([ds[int(a):int(b)] for a, b in ranges])


def _to_analysis(raw: np.ndarray) -> np.ndarray:
    """On-disk rows as analysis's event dtype: ``kind`` as str, as wide as the longest kind
    they hold (4 bytes a character: ``U24`` was 96 of an event's 136 bytes; arrays of other
    widths concatenate and compare alike). The kinds are coded on the way (``kinds.codes``),
    the str column written from the codes' names, the codes kept (``kinds.codes_of``)."""
    from . import kinds

    col = raw["kind"]
    narrow = col.dtype.kind == "S"
    code = kinds.codes(col) if narrow else np.empty(0, np.int64)
    used = np.flatnonzero(np.bincount(code)).tolist()  # the kinds these rows hold
    width = max([1] + [len(kinds.names()[c]) for c in used])
    dtype = np.dtype([(n, f"U{width}" if n == "kind" and narrow else EVENT_DTYPE[n])
                      for n in EVENT_FIELDS])
    ev = np.empty(raw.shape[0], dtype=dtype)
    for name in EVENT_FIELDS:
        ev[name] = kinds.named(dtype[name])[code] if name == "kind" and narrow else raw[name]
    if narrow:
        kinds.remember(ev, code)
    return ev
