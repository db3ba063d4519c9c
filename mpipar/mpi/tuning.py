"""Which collective algorithm to run, by kind, message size and communicator size.

``MPIPAR_COLLECTIVES=auto|library|ring|rabenseifner|shm|hier`` forces one algorithm for every
collective (``auto``, the default, chooses). ``shm`` (``shm.py``) runs only where every rank of
the communicator shares one node, ``hier`` (``hierarchical.py``; all-reduce and reduce-scatter)
only where they span nodes with two or more on some node; elsewhere, forced or chosen, each
falls back on what ``choose`` picks without it. ``auto`` reads the table ``mpipar commbench
--tune`` writes (``MPIPAR_COLLECTIVES_TABLE``, else ``~/.cache/mpipar/collectives.json`` when
it exists) and falls back on ``DEFAULT``. Every rank must see the same table (the same file on
a shared file system): ranks that choose differently would run different message patterns and hang.

Table file (JSON): ``{"version": 1, "mpi_library": "...", "topology": {"nodes": N,
"ranks_per_node": [...], "link": "1gbit" | "unknown"}, "choices": {kind: {comm size:
[[bytes, algorithm], ...]}}}``. The topology is the job's that tuned it: a job on another one
(``use_topology``, set by ``ProcessGrid`` and commbench) ignores the table, saying so in one line,
and takes the defaults; a table without one was tuned on one node.
Choices: the fastest algorithm measured at each size (the library's
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
import sys
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
# - across nodes (hierarchical.py; only where the ranks span nodes with two or more on some
#   node, elsewhere its rows are skipped): all-reduce and reduce-scatter from 1 MiB. Not measured
#   here (one machine): chosen by its bytes. Per node it sends n bytes over the link for two
#   nodes where the flat algorithms send about 2 n, at the price of two node barriers and a
#   node broadcast, a few tens of microseconds; from 1 MiB that price is below 1 % of the
#   link time even at 10 Gbit/s. Rerun --tune on the cluster to replace this reasoning.
# - nothing else: above 2 ranks without shared memory, no measurement here says the library
#   loses, and auto must never be slower than it (rerun --tune there).
# Rows: (from bytes, algorithm[, from ranks[, to ranks]]).
# - registered buffers (``shm_registered.py``: the gradient buckets live in a shared window),
#   their own rows: shm there copies nothing in or out (two barriers, n bytes read and written
#   per rank). Measured (commbench --sizes 128K..1M, 30 iterations, alone, load 0.82): the
#   all-reduce ties the library at 256 KiB (2 ranks 62.7 / 67.3 us, 4 ranks 288 / 249) and 384
#   KiB on 4 ranks, and wins from 512 KiB (70 / 100 us, 317 / 382); the reduce-scatter ties at
#   768 KiB and wins from 1 MiB (130 / 167, 546 / 645). Below, the choices for plain arrays.
DEFAULT = {
    "allreduce": [(0, "library"), (2 << 20, "rabenseifner", 2, 2), (4 << 20, "shm", 3),
                  (1 << 20, "hier", 3)],
    "reduce_scatter": [(0, "library"), (4 << 20, "shm"), (1 << 20, "hier", 3)],
    "allgather": [(0, "library")],
    "allreduce_registered": [(0, "library"), (2 << 20, "rabenseifner", 2, 2),
                             (512 << 10, "shm"), (1 << 20, "hier", 3)],
    "reduce_scatter_registered": [(0, "library"), (1 << 20, "shm"), (1 << 20, "hier", 3)],
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


def load(path, topology=None) -> dict:
    """The table's checked choices; {} when ``topology`` (the job's) is given and differs from
    the one the table was tuned on (then one line says so on stderr, from the first rank)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the collectives table {path}: {exc}; rerun mpipar "
                         f"commbench --tune or unset {ENV_TABLE}") from exc
    choices = validate(data, str(path))
    if topology is not None:
        tuned = data.get("topology") or ONE_NODE
        if not same_topology(tuned, topology):
            if _NOTE_RANK[0] == 0:
                d = describe_topology
                print(f"[mpipar] collectives table {path} was tuned on {d(tuned)}; this job "
                      f"runs on {d(topology)}: ignored (built-in defaults); rerun mpipar "
                      f"commbench --tune here", file=sys.stderr, flush=True)
            return {}
    return choices


ONE_NODE = {"nodes": 1}  # what a table without a topology was tuned on
_TABLE: dict | None = None
_TOPOLOGY: list = [None]  # the job's topology (use_topology), None: not known
_NOTE_RANK = [0]  # the rank that says a table was ignored


def same_topology(a: dict, b: dict) -> bool:
    """The same nodes and ranks per node, and the same link rate where a table gives one."""
    if int(a.get("nodes", 1)) != int(b.get("nodes", 1)):
        return False
    if "ranks_per_node" in a and list(a["ranks_per_node"]) != list(b.get("ranks_per_node", [])):
        return False
    return "link" not in a or str(a["link"]) == str(b.get("link", "unknown"))


def describe_topology(t: dict) -> str:
    """'2 node(s), ranks per node 2 x 2, link 1gbit'."""
    per = t.get("ranks_per_node") or []
    shape = (f"{len(per)} x {per[0]}" if per and len(set(per)) == 1
             else "+".join(str(c) for c in per) or "?")
    return f"{t.get('nodes', '?')} node(s), ranks per node {shape}, link {t.get('link', '?')}"


def use_topology(topology: dict, rank: int = 0) -> None:
    """The job's topology (``hierarchical.topology``): a table tuned on another is ignored.
    Called before the communicators are made (``ProcessGrid``, commbench)."""
    global _TABLE
    _TOPOLOGY[0], _NOTE_RANK[0] = topology, rank
    _TABLE = None


def table() -> dict:
    """The tuned choices ({} when there is none, or it was tuned on another topology); loaded
    once per process."""
    global _TABLE
    if _TABLE is None:
        # a table not written yet (the path `commbench --tune` is about to write) means the
        # built-in defaults; one that exists but cannot be read is an error
        p = Path(os.environ.get(ENV_TABLE, "").strip() or default_path())
        _TABLE = load(p, _TOPOLOGY[0]) if p.is_file() else {}
    return _TABLE


def choose(kind, nbytes, p, tuned=None, shm=True, hier=False) -> str:
    """The algorithm for a ``kind`` collective of ``nbytes`` over p ranks: nccl-tests' sizes, the
    per-rank buffer (all-reduce), the whole input (reduce-scatter) or output (all-gather).
    ``kind`` may name a registered buffer's rows (``REGISTERED``); a table without them (tuned
    before they existed) leaves them to the defaults. ``shm``: the ranks share one node (the
    default); ``hier``: they span nodes, two or more on some (``hierarchical.py``); neither:
    choose among the others."""
    tuned = table() if tuned is None else tuned
    by_size = tuned.get(kind)
    if by_size:
        key = min(by_size, key=lambda q: (abs(q - p), q))
        rows = by_size[key]
        x = math.log2(max(1, nbytes))
        algo = min(rows, key=lambda e: abs(math.log2(e[0]) - x))[1]
        if (shm or algo != "shm") and (hier or algo != "hier"):
            return algo
    algo = "library"
    for threshold, name, *ranks in DEFAULT[kind]:
        lo, hi = (ranks[0] if ranks else 2), (ranks[1] if len(ranks) > 1 else p)
        if (nbytes >= threshold and lo <= p <= hi and (shm or name != "shm")
                and (hier or name != "hier")):
            algo = name
    return algo


def choose_placed(kind, nbytes, p, shm_offered, hier_offered) -> str:
    """auto's choice for a group, asking where its ranks are only where that matters: the
    choice on one node (shm's rows) where it agrees with the one across nodes (hier's) or
    ``shm_offered()`` (collective the first time); else across nodes, hier only where
    ``hier_offered()`` (and never for all-gather)."""
    one = choose(kind, nbytes, p)
    across = choose(kind, nbytes, p, shm=False, hier=True)
    if one == across or shm_offered():
        return one
    if across == "hier" and not (kind != "allgather" and hier_offered()):
        return choose(kind, nbytes, p, shm=False)
    return across


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


def tuned_table(results: dict, library: str, topology: dict | None = None) -> dict:
    """The file ``--tune`` writes from {kind: {p: [(bytes, {algorithm: seconds})]}}, with the
    topology it was measured on (``hierarchical.topology``)."""
    choices = {
        kind: {str(p): [[int(b), pick(times)] for b, times in rows]
               for p, rows in by_p.items()}
        for kind, by_p in results.items()
    }
    out = {"version": 1, "mpi_library": library, "choices": choices}
    if topology is not None:
        out["topology"] = topology
    return out
