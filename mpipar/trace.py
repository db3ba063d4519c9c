"""The event recorder and the HDF5 timing dump writer (docs/dump_schema.md is the source of truth).

A leaf module: no MPI here (``mpipar.mpi.job.dump`` runs the flush; the per-rank parts layout is
``mpipar.trace_parts``; ``write_dump`` here writes the single-file schema 1), and h5py is
imported only inside ``write_dump`` so that tracing costs nothing to import.

Each rank owns one ``Tracer``. Events are kept as plain tuples in a list (appending a tuple is the
cheapest thing Python can do per event) and turned into the schema's structured array on demand.
A dump flush ``take``s them (and forgets them): memory holds only what came since the last flush.
A disabled tracer hands out one shared no-op context, so instrumented code costs a method call.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from time import perf_counter as _perf_counter

import numpy as np

from .files import atomic_h5, check_writable  # noqa: F401  (check_writable: callers import it here)
from .trace_parts import append_rows, rows_before

SCHEMA_VERSION = 1

KIND_LEN = 24  # bytes of the `kind` field (S24)

EVENT_DTYPE = np.dtype(
    [
        ("kind", f"S{KIND_LEN}"),
        ("step", "i4"),
        ("mb", "i4"),
        ("chunk", "i4"),
        ("start", "f8"),
        ("end", "f8"),
        ("bytes", "i8"),
        ("peer", "i4"),
    ]
)

METRICS_DTYPE = np.dtype(
    [
        ("step", "i4"),
        ("loss", "f8"),
        ("val_loss", "f8"),
        ("lr", "f8"),
        ("grad_norm", "f8"),
        ("tokens", "i8"),
        ("step_time", "f8"),
    ]
)

# what a metrics row holds when the caller leaves a field out
_METRICS_DEFAULTS = {
    "step": -1,
    "loss": np.nan,
    "val_loss": np.nan,
    "lr": np.nan,
    "grad_norm": np.nan,
    "tokens": 0,
    "step_time": np.nan,
}


class _NoOp:
    """The shared context a disabled tracer returns: enter and exit do nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOOP = _NoOp()


class _Region:
    """Times one ``with`` block and records it as one event (even when the block raises)."""

    __slots__ = ("tracer", "kind", "mb", "chunk", "nbytes", "peer", "start")

    def __init__(self, tracer, kind, mb, chunk, nbytes, peer):
        self.tracer = tracer
        self.kind = kind
        self.mb = mb
        self.chunk = chunk
        self.nbytes = nbytes
        self.peer = peer

    def __enter__(self):
        t = self.tracer
        if t._sync is not None:  # earlier GPU work must not be billed to this region
            t._sync()
        self.start = _perf_counter() - t.t0  # t.now(), without a call per region
        return self

    def __exit__(self, *exc):
        t = self.tracer
        if t._sync is not None:  # this region's GPU work must be finished before the end clock
            t._sync()
        if t.enabled:  # record_now's tuple, appended here: a region per compute action
            t._events.append((self.kind, t.step, self.mb, self.chunk, self.start,
                              _perf_counter() - t.t0, self.nbytes, self.peer))
        return False


class Clock(_Region):
    """One region re-armed for each block, ``with clock(kind, mb, chunk):``, for a hot loop whose
    regions never nest (the executor's compute actions), where a region object per block was a
    third of the calls per action. Micro-batch numbers are taken modulo ``wrap`` (a continuous
    schedule numbers them across steps; events carry the micro-batch within its step)."""

    __slots__ = ("wrap",)

    def __init__(self, tracer, wrap):
        super().__init__(tracer, "", -1, -1, 0, -1)
        self.wrap = wrap

    def __call__(self, kind, mb, chunk):
        self.kind, self.mb, self.chunk = kind, mb % self.wrap, chunk
        return self

    def run(self, kind, mb, chunk, fn, *args):
        """``fn(*args)`` timed as one event, as ``with clock(kind, mb, chunk):`` times its block
        (recorded even when it raises), in one call instead of three: after a compute action's
        NumPy work every Python frame entered costs a microsecond or two of cold caches
        (BENCHMARKS.md, "Eighth cuts")."""
        t = self.tracer
        sync = t._sync
        if sync is not None:  # earlier GPU work must not be billed to this event
            sync()
        t0 = t.t0
        start = _perf_counter() - t0
        try:
            return fn(*args)
        finally:
            if sync is not None:  # this event's GPU work finished before the end clock
                sync()
            if t.enabled:
                t._events.append((kind, t.step, mb % self.wrap, chunk, start,
                                  _perf_counter() - t0, 0, -1))


class Tracer:
    """Records timed events (kind, step, mb, chunk, start, end, bytes, peer) of one rank."""

    def __init__(self, enabled: bool = True, backend=None, rank: int = 0):
        self.enabled = bool(enabled)
        self.backend = backend
        self.rank = int(rank)
        self.step = -1
        self._events: list[tuple] = []
        self._metrics: list[tuple] = []
        self.dumped: set[str] = set()  # dump paths this run created (later flushes append)
        self.dump_runs: dict[str, str] = {}  # dump path -> run id agreed at its first flush
        gpu = backend is not None and getattr(backend, "is_gpu", False)
        self._sync = backend.synchronize if gpu else None
        self.reset_clock()

    # --- clock -------------------------------------------------------------------------------

    def now(self) -> float:
        """Seconds since t0."""
        return time.perf_counter() - self.t0

    def reset_clock(self) -> None:
        """Start the clock now. Call right after a world barrier so ranks share (nearly) one t0."""
        self.t0 = time.perf_counter()
        self.start_time = _dt.datetime.now(_dt.timezone.utc).isoformat()

    # --- recording ---------------------------------------------------------------------------

    def region(self, kind: str, mb: int = -1, chunk: int = -1, nbytes: int = 0, peer: int = -1):
        """A context manager recording one event spanning the ``with`` block."""
        if not self.enabled:
            return _NOOP
        _check_kind(kind)
        return _Region(self, kind, int(mb), int(chunk), int(nbytes), int(peer))

    def record(self, kind, start, end, mb=-1, chunk=-1, nbytes=0, peer=-1) -> None:
        """Record an event measured by the caller (times in seconds since t0, see ``now``)."""
        if not self.enabled:
            return
        _check_kind(kind)
        self._events.append(
            (kind, self.step, int(mb), int(chunk), float(start), float(end), int(nbytes), int(peer))
        )

    def record_now(self, kind, start, mb=-1, chunk=-1, nbytes=0, peer=-1) -> None:
        """Record an event from ``start`` until now, without ``record``'s checks and conversions.

        For per-message hot paths (``Comm``, regions): the caller passes ints, a float start
        and a kind already known to fit ``KIND_LEN``. Does nothing when disabled.
        """
        if self.enabled:
            end = time.perf_counter() - self.t0
            self._events.append((kind, self.step, mb, chunk, start, end, nbytes, peer))

    def sink(self):
        """The list's ``append`` taking ``record_now``'s tuples with times already relative to
        ``t0``, for a per-message hot path (``mpi/p2p.py``); None when disabled. The list is
        cleared in place, never replaced, so the ``append`` stays valid for the tracer's life."""
        return self._events.append if self.enabled else None

    def sync(self) -> None:
        """Wait for queued GPU work when tracing a GPU backend (clocks must not run ahead)."""
        if self._sync is not None:
            self._sync()

    def events(self) -> np.ndarray:
        """All events so far, in recording order, as an ``EVENT_DTYPE`` array."""
        return np.array(self._events, dtype=EVENT_DTYPE)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(events, metrics) recorded since the last ``take``, forgotten here: a dump flush
        writes them and memory stays bounded however long the run."""
        out = self.events(), self.metrics()
        self.clear()
        return out

    def clear(self) -> None:
        """Forget the events and metrics recorded so far (the clock keeps running)."""
        self._events.clear()
        self._metrics.clear()

    # --- metrics -----------------------------------------------------------------------------

    def add_metrics(self, **row) -> None:
        """Append one /metrics row; fields left out get NaN (floats), -1 (step) or 0 (tokens)."""
        unknown = set(row) - set(_METRICS_DEFAULTS)
        if unknown:
            raise ValueError(
                f"unknown metrics field(s) {sorted(unknown)}; "
                f"the schema has {list(_METRICS_DEFAULTS)}"
            )
        full = {**_METRICS_DEFAULTS, **row}
        self._metrics.append(tuple(full[name] for name in METRICS_DTYPE.names))

    def metrics(self) -> np.ndarray:
        return np.array(self._metrics, dtype=METRICS_DTYPE)


def _check_kind(kind: str) -> None:
    # numpy would silently cut a longer name; an analysis keyed on kinds must not see that
    if len(kind) > KIND_LEN:
        raise ValueError(f"event kind {kind!r} is longer than {KIND_LEN} characters")


# --- the HDF5 file -----------------------------------------------------------------------------


def _attr_value(value):
    """Schema attributes are ints, bools or strings; dicts and lists are stored as JSON text."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    if value is None:
        return ""
    return value


# rows per HDF5 chunk of the appendable datasets (64 B per event row: 64 KiB chunks)
EVENT_CHUNK, METRICS_CHUNK = 1024, 256


def _check_dtypes(per_rank_events, rank_attrs, metrics) -> list:
    if len(rank_attrs) != len(per_rank_events):
        raise ValueError(
            f"{len(per_rank_events)} ranks of events but {len(rank_attrs)} rank attribute dicts"
        )
    out = []
    for r, ev in enumerate(per_rank_events):
        ev = np.asarray(ev)
        if ev.dtype != EVENT_DTYPE:
            raise ValueError(f"rank {r}: events have dtype {ev.dtype}, not EVENT_DTYPE")
        out.append(ev)
    if metrics is not None and np.asarray(metrics).dtype != METRICS_DTYPE:
        raise ValueError(f"metrics have dtype {np.asarray(metrics).dtype}, not METRICS_DTYPE")
    return out


def _set_attrs(obj, attrs: dict) -> None:
    for key, value in attrs.items():
        if key not in ("schema_version", "committed"):
            obj.attrs[key] = _attr_value(value)


def write_dump(
    path, per_rank_events: list, rank_attrs: list, file_attrs: dict, metrics=None
) -> None:
    """Write a new dump to ``path`` atomically (temp file in the same directory, then rename),
    replacing any file there; ``append_dump`` adds to it later.

    ``per_rank_events[r]`` are world rank r's events (EVENT_DTYPE), ``rank_attrs[r]`` the
    attributes of ``/ranks/r``; ``file_attrs`` become the file's attributes (``schema_version``
    and ``committed`` are always set here). A failure at any point leaves the previous file, if
    any, untouched. The datasets are chunked and resizable, so later flushes append to them.
    """
    events = _check_dtypes(per_rank_events, rank_attrs, metrics)
    m = np.asarray(metrics if metrics is not None else np.empty(0, METRICS_DTYPE))
    with atomic_h5(path) as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        _set_attrs(f, file_attrs)
        ranks = f.create_group("ranks")
        for r, (ev, attrs) in enumerate(zip(events, rank_attrs, strict=True)):
            g = ranks.create_group(str(r))
            g.create_dataset("events", data=ev, maxshape=(None,), chunks=(EVENT_CHUNK,))
            _set_attrs(g, attrs)
        f.create_dataset("metrics", data=m, maxshape=(None,), chunks=(METRICS_CHUNK,))
        f.attrs["committed"] = _committed([len(ev) for ev in events], len(m))


def _committed(events: list, metrics: int) -> str:
    return json.dumps({"events": [int(n) for n in events], "metrics": int(metrics)})


def append_dump(
    path, per_rank_events: list, rank_attrs: list, file_attrs: dict, metrics=None
) -> None:
    """Append new events (and metrics rows) to the dump ``write_dump`` created at ``path``, and
    update its attributes (e.g. ``complete``). Cost: the new rows only, never the history.

    Crash safety (docs/dump_schema.md): the rows are written after the committed ones and
    flushed, and only then the file attribute ``committed`` (the row counts readers trust, one
    attribute for all ranks) is updated; a failure in between leaves rows that readers ignore.
    Rows already committed are never rewritten (no compression, so chunks stay in place).
    """
    import h5py

    events = _check_dtypes(per_rank_events, rank_attrs, metrics)
    # locking=False: a reader (``mpipar analyze`` during the run) holding the file must not make
    # the flush, and so the run, fail; readers trust only the committed rows anyway
    with h5py.File(path, "r+", locking=False) as f:
        done = json.loads(f.attrs["committed"])
        if len(done["events"]) != len(events):
            raise ValueError(f"{path} holds {len(done['events'])} ranks, not {len(events)}")
        counts = []
        for r, (ev, attrs) in enumerate(zip(events, rank_attrs, strict=True)):
            counts.append(append_rows(f[f"ranks/{r}/events"], done["events"][r], ev))
            _set_attrs(f[f"ranks/{r}"], attrs)
        m = np.asarray(metrics if metrics is not None else np.empty(0, METRICS_DTYPE))
        n_metrics = append_rows(f["metrics"], done["metrics"], m)
        f.flush()  # the rows reach the file before the count that makes them visible
        f.attrs["committed"] = _committed(counts, n_metrics)
        f.flush()
        _set_attrs(f, file_attrs)  # after the rows: `complete` never runs ahead of them


def rewind_dump(path, step: int, n_ranks: int) -> bool:
    """Let a run resumed at ``step`` continue the dump of the run it resumes; True when later
    flushes may append to it. An index and its parts (schema 2): ``trace_parts.rewind_parts``;
    a single file (schema 1, ``write_dump``): ``_rewind_single_file``."""
    import h5py

    from .trace_parts import SCHEMA_VERSION as PARTS_VERSION
    from .trace_parts import rewind_parts

    try:
        with h5py.File(path, "r", locking=False) as f:
            version = int(f.attrs.get("schema_version", 0))
    except (OSError, ValueError, TypeError):
        return False
    if version == PARTS_VERSION:
        return rewind_parts(path, step, n_ranks)
    return _rewind_single_file(path, step, n_ranks)


def _rewind_single_file(path, step: int, n_ranks: int) -> bool:
    """Let a run resumed at ``step`` continue the dump of the run it resumes: keep the committed
    rows of the steps before ``step`` (a crash may have flushed later ones, which the resumed run
    does again), mark the file incomplete, and say whether later flushes may append to it.
    False (the first flush then writes a new file, as before): no dump there, one written
    before appends existed, or one of another world size. Event times of the resumed part start
    again from its own clock (docs/dump_schema.md)."""
    import h5py

    if not os.path.isfile(path):
        return False
    try:
        with h5py.File(path, "r+", locking=False) as f:
            if "committed" not in f.attrs:
                return False
            done = json.loads(f.attrs["committed"])
            if len(done["events"]) != n_ranks:
                return False

            counts = [rows_before(f[f"ranks/{r}/events"], n, step)
                      for r, n in enumerate(done["events"])]
            f.attrs["committed"] = _committed(counts, rows_before(f["metrics"], done["metrics"],
                                                                    step))
            f.attrs["complete"] = False
    except (OSError, KeyError, ValueError):
        return False
    return True

