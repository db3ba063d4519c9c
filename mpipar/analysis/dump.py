"""Reading one HDF5 timing dump (docs/dump_schema.md, schema version 1) into a ``Run``.

Only the rows the ``committed`` attribute counts are read (the tail of a flush that crashed is
ignored); dumps written before that attribute existed are read whole.

Only h5py and numpy: analysis never imports MPI. Every problem with a file (missing, not HDF5,
another schema version, a missing attribute or field) is a ``DumpError`` that names the file,
what is wrong and what to do, because the person reading it usually did not write the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

# The writer's on-disk layout is the contract (mpipar.trace is a leaf: no MPI in it).
from ..trace import EVENT_DTYPE as DISK_EVENT_DTYPE
from ..trace import SCHEMA_VERSION  # noqa: F401 (re-exported)

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

    def coord(self, rank: int) -> dict:
        dp, pp, tp = (int(v) for v in self.coords[rank])
        return {"dp": dp, "pp": pp, "tp": tp}

    def label(self, rank: int) -> str:
        """Row label of a rank in tables and plots: ``r3 dp1/pp0/tp1``."""
        c = self.coord(rank)
        return f"r{rank} dp{c['dp']}/pp{c['pp']}/tp{c['tp']}"

    def steps(self) -> list[int]:
        """Training steps (>= 0) that have events on any rank, sorted."""
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


def load(path, name: str | None = None) -> Run:
    """Read and validate the dump at ``path``; ``DumpError`` (with the fix) when it is unusable."""
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
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DumpError(f"{path}: not a readable HDF5 file ({exc}); {_RERUN}") from None
    try:
        with f:
            return _load_open(path, f, name)
    except DumpError:
        raise
    except (UnicodeDecodeError, OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:
        # a damaged file (e.g. flipped bits) fails deep inside h5py or a decode
        raise DumpError(f"{path}: damaged timing dump, cannot read it ({type(exc).__name__}: "
                        f"{exc}); {_RERUN}") from None


def _load_open(path, f, name) -> Run:
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
    committed = _committed(path, attrs, world)
    events, coords, rank_attrs = _read_ranks(path, f, world, committed)
    metrics = _rows(path, f["metrics"], committed, "metrics") if "metrics" in f else None
    if metrics is not None and not len(metrics):
        metrics = None
    return Run(
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
    )


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
            f"{path}: dump schema_version {version} is older than the version "
            f"{SCHEMA_VERSION} this "
            f"mpipar reads; analyse it with the mpipar that wrote it, or {_RERUN}"
        )
    if version > SCHEMA_VERSION:
        raise DumpError(
            f"{path}: dump schema_version {version} is newer than the version "
            f"{SCHEMA_VERSION} this "
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
    """The row counts the writer committed (``committed`` attribute, JSON); None in dumps
    written before it existed, whose datasets hold only committed rows."""
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


def _read_ranks(path, f, world, committed=None):
    if "ranks" not in f:
        raise DumpError(f"{path}: group '/ranks' is missing (no events were written); {_RERUN}")
    events, coords, rank_attrs = [], np.zeros((world, 3), dtype=int), []
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
        raw = _rows(path, g["events"], committed, f"/ranks/{r}/events", rank=r)
        names = raw.dtype.names or ()
        for name in EVENT_FIELDS:
            if name not in names:
                raise DumpError(
                    f"{path}: dataset '/ranks/{r}/events' has no field '{name}' "
                    f"(fields: {list(names)}); "
                    f"the dump does not follow docs/dump_schema.md: {_RERUN}"
                )
        ev = np.empty(raw.shape[0], dtype=EVENT_DTYPE)
        for name in EVENT_FIELDS:
            ev[name] = (
                np.char.decode(raw[name])
                if name == "kind" and raw.dtype[name].kind == "S"
                else raw[name]
            )
        events.append(ev)
        a = {k: _decode(v) for k, v in g.attrs.items()}
        for axis in RANK_ATTRS:
            if axis not in a:
                raise DumpError(f"{path}: attribute '{axis}' of '/ranks/{r}' is missing; {_RERUN}")
        coords[r] = [int(a["dp"]), int(a["pp"]), int(a["tp"])]
        rank_attrs.append(a)
    return events, coords, rank_attrs
