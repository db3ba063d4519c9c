"""Which collective algorithm to run, by kind, message size and communicator size.

``MPIPAR_COLLECTIVES=auto|library|ring|rabenseifner|shm`` forces one algorithm for every
collective (``auto``, the default, chooses). ``shm`` (``shm.py``) runs only where every rank of
the communicator shares one node; elsewhere, forced or chosen, it falls back on what ``choose``
picks without it. ``auto`` reads the table ``mpipar commbench --tune`` writes
(``MPIPAR_COLLECTIVES_TABLE``, else ``~/.cache/mpipar/collectives.json`` when it exists) and
falls back on ``DEFAULT``. Every rank must see the same table (the same file on a shared file
system): ranks that choose differently would run different message patterns and hang.

Table file (JSON): ``{"version": 1, "mpi_library": "...", "choices": {kind: {comm size:
[[bytes, algorithm], ...]}}}``, the fastest algorithm measured at each size (the library's
unless another beat it by ``MARGIN``); a message takes the choice measured at the nearest size
(on a log scale), a communicator size not in the table the nearest one measured. Kinds:
``allreduce``, ``reduce_scatter``, ``allgather``, and ``allreduce_registered`` /
``reduce_scatter_registered`` for arrays that are registered buffers (``shm_registered.py``),
whose shm path copies nothing and so has rows of its own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from mpipar.mpi.algorithms import ALGORITHMS, KINDS

ENV_MODE = "MPIPAR_COLLECTIVES"
ENV_TABLE = "MPIPAR_COLLECTIVES_TABLE"
MODES = ("auto",) + ALGORITHMS

# Without a tuned table the library, unless a measurement here showed another algorithm ahead
# (commbench, random order, raw and Comm on the same buffers; BENCHMARKS.md):
# - all-reduce on 2 ranks from 2 MiB: exchange halves (Rabenseifner with one step). At 1 MiB it
#   ties the library (141.7 / 142.7 us, 451 / 531 in a slower minute), from 4 MiB it wins, and
#   at 64 MiB by 3x (BENCHMARKS.md: MPICH maps its temporary afresh for every call).
# - shared memory (shm.py; only where the ranks share one node, elsewhere its rows are skipped):
#   all-reduce from 4 MiB on 3 ranks or more (one pass and three barriers where the others take
#   2 log2 p or 2 (p - 1) message steps; on 2 ranks it copies each rank's own half once more
#   than exchanging halves and measured slower); reduce-scatter from 4 MiB (the library's
#   bytes with two barriers and no kernel copies; at 1 MiB the library was 3x ahead of ring and
#   Rabenseifner and 2.7x ahead of shm). Not all-gather: it copies every block twice where the
#   library's ring copies it once, and that ring is already near the copy bandwidth. Never
#   for device arrays under auto (``Comm.algorithm_for``): shm would copy them through the host.
# - nothing else: across nodes, or above 2 ranks without shared memory, no measurement here
#   says the library loses, and auto must never be slower than it (rerun --tune there).
# Rows: (from bytes, algorithm[, from ranks[, to ranks]]).
# - registered buffers (``shm_registered.py``: the gradient buckets live in a shared window),
#   their own rows: shm there copies nothing in or out (two barriers, n bytes read and written
#   per rank). Measured (commbench --sizes 128K..1M, 30 iterations, alone, load 0.82): the
#   all-reduce ties the library at 256 KiB (2 ranks 62.7 / 67.3 us, 4 ranks 288 / 249) and 384
#   KiB on 4 ranks, and wins from 512 KiB (70 / 100 us, 317 / 382); the reduce-scatter ties at
#   768 KiB and wins from 1 MiB (130 / 167, 546 / 645). Below, the choices for plain arrays.
DEFAULT = {
    "allreduce": [(0, "library"), (2 << 20, "rabenseifner", 2, 2), (4 << 20, "shm", 3)],
    "reduce_scatter": [(0, "library"), (4 << 20, "shm")],
    "allgather": [(0, "library")],
    "allreduce_registered": [(0, "library"), (2 << 20, "rabenseifner", 2, 2),
                             (512 << 10, "shm")],
    "reduce_scatter_registered": [(0, "library"), (1 << 20, "shm")],
}
# the kinds whose arrays may be registered buffers, and their rows' names in DEFAULT and tables
REGISTERED = {"allreduce": "allreduce_registered", "reduce_scatter": "reduce_scatter_registered"}
TABLE_KINDS = KINDS + tuple(REGISTERED.values())


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpipar" / "collectives.json"


def mode() -> str:
    """The forced algorithm, or "auto"; a bad value is an error naming the variable."""
    value = os.environ.get(ENV_MODE, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r} is not one of {'|'.join(MODES)}")
    return value


def validate(table: dict, source="table") -> dict:
    """``table["choices"]`` checked: kinds, sizes and algorithm names."""
    choices = table.get("choices") if isinstance(table, dict) else None
    if not isinstance(choices, dict):
        raise ValueError(f"{source}: no 'choices' object; rerun mpipar commbench --tune")
    out = {}
    for kind, by_size in choices.items():
        if kind not in TABLE_KINDS:
            raise ValueError(f"{source}: unknown collective {kind!r} (expected one of "
                             f"{TABLE_KINDS})")
        out[kind] = {}
        for p, rows in by_size.items():
            entries = []
            for nbytes, algo in rows:
                if algo not in ALGORITHMS or int(nbytes) < 1:
                    raise ValueError(f"{source}: bad entry [{nbytes}, {algo!r}] for {kind} on "
                                     f"{p} ranks (algorithms: {ALGORITHMS})")
                entries.append((int(nbytes), algo))
            out[kind][int(p)] = sorted(entries)
    return out


def load(path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the collectives table {path}: {exc}; rerun mpipar "
                         f"commbench --tune or unset {ENV_TABLE}") from exc
    return validate(data, str(path))


_TABLE: dict | None = None


def table() -> dict:
    """The tuned choices ({} when there is none); loaded once per process."""
    global _TABLE
    if _TABLE is None:
        # a table not written yet (the path `commbench --tune` is about to write) means the
        # built-in defaults; one that exists but cannot be read is an error
        p = Path(os.environ.get(ENV_TABLE, "").strip() or default_path())
        _TABLE = load(p) if p.is_file() else {}
    return _TABLE


def choose(kind, nbytes, p, tuned=None, shm=True) -> str:
    """The algorithm for a ``kind`` collective of ``nbytes`` over p ranks: nccl-tests' sizes, the
    per-rank buffer (all-reduce), the whole input (reduce-scatter) or output (all-gather).
    ``kind`` may name a registered buffer's rows (``REGISTERED``); a table without them (tuned
    before they existed) leaves them to the defaults. ``shm=False``: the ranks span nodes,
    choose among the others (the defaults)."""
    tuned = table() if tuned is None else tuned
    by_size = tuned.get(kind)
    if by_size:
        key = min(by_size, key=lambda q: (abs(q - p), q))
        rows = by_size[key]
        x = math.log2(max(1, nbytes))
        algo = min(rows, key=lambda e: abs(math.log2(e[0]) - x))[1]
        if shm or algo != "shm":
            return algo
    algo = "library"
    for threshold, name, *ranks in DEFAULT[kind]:
        lo, hi = (ranks[0] if ranks else 2), (ranks[1] if len(ranks) > 1 else p)
        if nbytes >= threshold and lo <= p <= hi and (shm or name != "shm"):
            algo = name
    return algo


# An algorithm of ours replaces the library's in the tuned table only where it was at least
# this much faster: where they are within the noise of one run (1 MiB on 2 ranks), a choice made
# by chance could lose to the library in the next run, and auto must never be slower than it.
MARGIN = 1.10


def pick(times: dict) -> str:
    """The algorithm ``--tune`` writes for one size: the fastest, unless the library is within
    ``MARGIN`` of it."""
    times = {a: t for a, t in times.items() if t == t}  # NaN: not measured (shm across nodes)
    best = min(times, key=times.get)
    lib = times.get("library")
    if lib is not None and best != "library" and times[best] * MARGIN > lib:
        return "library"
    return best


def tuned_table(results: dict, library: str) -> dict:
    """The file ``--tune`` writes from {kind: {p: [(bytes, {algorithm: seconds})]}}."""
    choices = {
        kind: {str(p): [[int(b), pick(times)] for b, times in rows]
               for p, rows in by_p.items()}
        for kind, by_p in results.items()
    }
    return {"version": 1, "mpi_library": library, "choices": choices}
