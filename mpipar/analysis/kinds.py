"""Event kinds as small integer codes, so that per-rank analysis works on ints, not strings.

A rank's ``kind`` column is a str (U24) per event; one ``np.unique`` of it (a string sort)
cost 6.4 ms a rank, and the breakdown and collective totals did several, plus masks by string
comparison: most of a 1,024-rank analysis. Here a kind's code is its index in one table per
process: the kinds the trainer records (``KNOWN``) first, any other appended when first seen,
so a code means the same kind in every array. ``codes`` finds them with one hash per event (the
string's bytes as machine words, multiplied in) looked up among the table's hashes, then checks
every event's kind against its code's name, so the codes are exact (a hash collision or a kind
too long for the table falls back to ``np.unique``). Questions about kinds (its axis, is it a
collective) are answered once per table entry (``table``) and read per event by indexing.
"""

from __future__ import annotations

import numpy as np

COMPUTE = ("F", "B", "W", "R", "LOSS", "OPT")
KNOWN = ("STEP",) + COMPUTE + (
    "pp.send", "pp.recv", "pp.wait", "tp.allreduce", "tp.allgather", "tp.reduce_scatter",
    "tp.broadcast", "tp.wait", "dp.allreduce", "dp.reduce_scatter", "dp.allgather", "dp.wait",
    "world.allreduce", "mem.static", "mem.base", "mem.peak")

STEP = 0  # KNOWN.index("STEP")

_names: list[str] = list(KNOWN)
_index: dict[str, int] = {k: i for i, k in enumerate(KNOWN)}
_hashes: dict = {}  # (dtype str, table size) -> (sorted hashes, their codes)
_tables: dict = {}  # (question, table size) -> per-code answers
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: each word's bits spread over the hash


def names() -> list[str]:
    """The kind of each code (the table as it stands; it only grows)."""
    return _names


def code(kind: str) -> int:
    """The code of ``kind`` (added to the table when new)."""
    if kind not in _index:
        _index[kind] = len(_names)
        _names.append(kind)
    return _index[kind]


def _hash(a: np.ndarray) -> np.ndarray:
    """One uint64 per string of ``a`` (contiguous, fixed width) from its machine words."""
    size = a.dtype.itemsize
    word = np.uint64 if size % 8 == 0 else np.uint32 if size % 4 == 0 else np.uint8
    words = a.view(word).reshape(len(a), -1)
    h = np.zeros(len(a), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):
            h = h * _MULT + words[:, j]
    return h


def _table_hashes(dtype) -> tuple:
    key = (dtype.str, len(_names))
    got = _hashes.get(key)
    if got is None:
        width = dtype.itemsize // (4 if dtype.kind == "U" else 1)
        fit = [i for i, k in enumerate(_names) if len(k.encode() if dtype.kind == "S" else k)
               <= width]
        enc = np.array([_names[i] for i in fit], dtype=dtype)
        h = _hash(enc)
        order = np.argsort(h)
        got = _hashes[key] = (h[order], np.asarray(fit, np.int64)[order])
    return got


def codes(kinds) -> np.ndarray:
    """The code (int64) of every kind in ``kinds`` (a str or bytes array, or a list)."""
    a = np.ascontiguousarray(np.asarray(kinds))
    if a.dtype.kind not in "US":
        a = a.astype(str)
    a = a.reshape(-1)
    if not a.size:
        return np.empty(0, np.int64)
    h = _hash(a)
    for _ in range(2):  # a second time once unknown kinds are in the table
        th, tc = _table_hashes(a.dtype)
        at = np.minimum(np.searchsorted(th, h), th.size - 1)
        found = th[at] == h
        if found.all():
            break
        for k in np.unique(a[~found]).tolist():
            code(k.decode() if isinstance(k, bytes) else k)
    out = tc[at]
    if not found.all() or not np.array_equal(named(a.dtype)[out], a):
        return _exact(a)  # a collision, or a kind wider than the table's: by sorting
    return out


def named(dtype) -> np.ndarray:
    """The table's names as ``dtype``, indexed by code (a name too wide for ``dtype`` is cut;
    ``codes`` never gives its code for an array of that dtype)."""
    key = ("named", dtype.str, len(_names))
    got = _hashes.get(key)
    if got is None:
        enc = [k.encode() for k in _names] if dtype.kind == "S" else _names
        got = _hashes[key] = np.array(enc).astype(dtype)
    return got


def _exact(a: np.ndarray) -> np.ndarray:
    uniq, inv = np.unique(a, return_inverse=True)
    got = np.array([code(k.decode() if isinstance(k, bytes) else k) for k in uniq.tolist()],
                   np.int64)
    return got[inv.reshape(-1)]


def table(question, fill=None) -> np.ndarray:
    """``question(kind)`` for every code (an array indexed by code), worked out once per kind.
    ``question`` is a module-level function (its identity keys the cache)."""
    key = (question, len(_names))
    got = _tables.get(key)
    if got is None:
        got = _tables[key] = np.array([question(k) for k in _names])
    return got


def is_compute(kind: str) -> bool:
    return kind in COMPUTE


def axis(kind: str) -> str:
    """``tp`` of ``tp.allreduce``; "" for a kind without a dot."""
    return kind.partition(".")[0] if "." in kind else ""


def op(kind: str) -> str:
    """``allreduce`` of ``tp.allreduce``; "" for a kind without a dot."""
    return kind.partition(".")[2]


def is_mem(kind: str) -> bool:
    return kind.startswith("mem.")


# the codes of recently coded event arrays, keyed by the array's id and holding the array (so the
# id is not reused while the entry lives): a rank's events are coded once when read
# (``stream``), and the subsets ``index.events_in`` selects take their codes from it
_RECENT: dict = {}
_KEEP = 8  # a rank read, its selections and residue: a few arrays at a time


def codes_of(ev: np.ndarray) -> np.ndarray:
    """``codes(ev["kind"])`` of an event array, worked out once per array."""
    got = _RECENT.get(id(ev))
    if got is not None and got[0] is ev:
        return got[1]
    return remember(ev, codes(ev["kind"]))


def remember(ev: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Keep ``c`` as the codes of ``ev`` (``codes_of``); the oldest entries go first."""
    while len(_RECENT) >= _KEEP:
        del _RECENT[next(iter(_RECENT))]
    _RECENT[id(ev)] = (ev, c)
    return c


def known(ev: np.ndarray):
    """The codes of ``ev`` when already worked out, else None."""
    got = _RECENT.get(id(ev))
    return got[1] if got is not None and got[0] is ev else None
