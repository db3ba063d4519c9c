"""Collectives for ``mpipar commbench``: raw mpi4py beside ``Comm`` with each algorithm forced.

For all-reduce, reduce-scatter and all-gather, every iteration runs the raw library call and
``Comm`` with ``library``, ``ring``, ``rabenseifner``, ``shm`` (NaN where the ranks span nodes),
``hier`` (NaN unless they span nodes with two or more on some node) and ``auto`` (the choice in
effect), in a random order drawn per iteration (the same on every rank: a fixed seed). Not a
rotation of one order: that keeps each variant behind the same neighbour, and what the neighbour
leaves in the caches moved one variant's median by up to 2x (shm behind shm against shm behind
rabenseifner, 16 MiB reduce-scatter); a barrier starts each, and an iteration lasts as long as its
slowest rank; below 256 KiB a timed sample is ``reps_for`` calls in a row (the time reported is
per call). Sizes follow nccl-tests: the
per-rank buffer for all-reduce, the whole input for reduce-scatter, the whole output for
all-gather; bus bandwidth = algbw * 2 (n-1)/n for all-reduce and algbw * (n-1)/n for the other
two (algbw = bytes / time).

All-reduce and reduce-scatter are timed a second time on a registered buffer
(``Comm.registered_zeros``, where the ranks share a node and the arrays are host memory): the
rows ``allreduce_registered`` / ``reduce_scatter_registered``, raw and every variant on the SAME
registered buffer (one, sized for the largest message; each size its leading elements), auto
choosing from the registered rows (``tuning.REGISTERED``), shm there the zero-copy path.
"""

from __future__ import annotations

import time

import numpy as np

from mpipar.mpi.algorithms import ALGORITHMS
from mpipar.mpi.tuning import REGISTERED, pick

VARIANTS = ("raw",) + ALGORITHMS + ("auto",)

COLL_DTYPE = np.dtype(
    [
        ("bytes", "i8"),
        ("raw_s", "f8"),  # median time, raw mpi4py library call
        ("library_s", "f8"),  # Comm, each algorithm forced
        ("ring_s", "f8"),
        ("rabenseifner_s", "f8"),
        ("shm_s", "f8"),  # NaN: not offered (the ranks span nodes)
        ("hier_s", "f8"),  # NaN: not offered (one node, or one rank per node)
        ("auto_s", "f8"),  # Comm with the choice in effect (table or default)
        ("choice", "S12"),  # the algorithm auto ran
        ("best", "S12"),  # what --tune writes: the fastest, unless the library is within MARGIN
        ("ratio", "f8"),  # auto_s / raw_s
        ("raw_busbw", "f8"),  # GB/s (1e9 bytes/s)
        ("auto_busbw", "f8"),
        ("best_busbw", "f8"),
    ]
)


def reps_for(nbytes: int) -> int:
    """Back-to-back operations one timed sample holds: many for small messages (a single one
    lasts a few microseconds, no longer than a barrier's exit skew or the clock calls around it,
    so one per sample would measure those), one from 256 KiB up."""
    return max(1, min(64, (256 << 10) // max(1, nbytes)))


def bus_factor(kind, n) -> float:
    return 2 * (n - 1) / n if kind == "allreduce" else (n - 1) / n


def elements(kind, nbytes, n) -> int:
    """float32 elements of the per-rank buffer: whole, and a multiple of n where it splits."""
    e = max(1, nbytes // 4)
    return e if kind == "allreduce" else max(n, e - e % n)


def _calls(kind, world, mpi_comm, MPI, e, xp, raw_xp, reg=None):
    """{variant: (mode, call)} for one size; buffers made once (zeros keep repeated sums
    finite). Raw and Comm work on the same buffers where both are host memory: two buffers
    of one size measured up to 45 % apart with the same library call (16 MiB all-reduce), so
    separate ones would time where pages landed, not Comm. ``reg``: a registered float32 buffer
    whose first elements are the input (the registered rows)."""
    n = mpi_comm.Get_size()
    ins, outs = {"allreduce": (e, 0), "reduce_scatter": (e, e // n)}.get(kind, (e // n, e))
    x = xp.zeros(ins, np.float32) if reg is None else reg[:ins]
    out = xp.zeros(outs, np.float32) if outs else None  # reused, as ZeRO-1's shard/flat params
    raw_x, raw_out = (x, out) if raw_xp is xp else (
        raw_xp.zeros(ins, np.float32), raw_xp.zeros(outs, np.float32) if outs else None)
    if kind == "allreduce":
        def raw():
            mpi_comm.Allreduce(MPI.IN_PLACE, raw_x, MPI.SUM)

        def comm():
            world.allreduce(x, inplace=True)
    elif kind == "reduce_scatter":
        def raw():
            mpi_comm.Reduce_scatter_block(raw_x, raw_out, MPI.SUM)

        def comm():
            world.reduce_scatter(x, out=out)
    else:
        def raw():
            mpi_comm.Allgather(raw_x, raw_out)

        def comm():
            world.allgather(x, out=out)

    # (mode set before the clock starts, call): every timed call is one closure calling one
    # method, raw and Comm alike, so the ratio is Comm's own work
    return {"raw": (None, raw), **{a: (a, comm) for a in ALGORITHMS + ("auto",)}}


def bench_kind(kind, world, mpi_comm, MPI, sizes, iters, warmup, xp, raw_xp, reg=None):
    """(rows of COLL_DTYPE on rank 0, samples [variant, size, iteration]) for one kind; on the
    registered buffer ``reg`` (all-reduce, reduce-scatter) when given."""
    name = kind if reg is None else REGISTERED[kind]  # the table's rows auto chooses from
    n = mpi_comm.Get_size()
    mode = world.coll_mode
    # forced where they cannot run, they would time a fallback
    skip = tuple(a for a, offered in (("shm", world.shm_offered()),
                                       ("hier", world.windows.hier_offered())) if not offered)
    samples = np.zeros((len(VARIANTS), len(sizes), iters))
    choices = []
    for j, size in enumerate(sizes):
        e = elements(kind, size, n)
        reps = range(reps_for(e * 4))
        calls = _calls(kind, world, mpi_comm, MPI, e, xp, raw_xp, reg)
        choices.append(world.algorithm(name, e * 4) if mode == "auto" else mode)
        times = np.zeros((len(VARIANTS), warmup + iters))
        rng = np.random.default_rng(1000 + j)  # the same orders on every rank
        for i in range(warmup + iters):
            for v in (VARIANTS[k] for k in rng.permutation(len(VARIANTS))):
                if v in skip:
                    continue
                algo, call = calls[v]
                if algo is not None:
                    world.coll_mode = algo if algo != "auto" else mode
                mpi_comm.Barrier()
                t = time.perf_counter()
                for _ in reps:
                    call()
                times[VARIANTS.index(v), i] = (time.perf_counter() - t) / len(reps)
        world.coll_mode = mode
        mpi_comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)  # the slowest rank's time
        samples[:, j] = times[:, warmup:]
    for v in skip:
        samples[VARIANTS.index(v)] = np.nan
    byte_counts = [elements(kind, s, n) * 4 for s in sizes]
    return table(name, n, byte_counts, samples, choices), samples


def table(kind, n, byte_counts, samples, choices):
    rows = np.zeros(len(byte_counts), dtype=COLL_DTYPE)
    f = bus_factor(kind.removesuffix("_registered"), n)
    for j, b in enumerate(byte_counts):
        med = {v: float(np.median(samples[k, j])) for k, v in enumerate(VARIANTS)}
        best = pick({a: med[a] for a in ALGORITHMS})
        row = rows[j]
        for v in VARIANTS:
            row[f"{v}_s"] = med[v]
        row["bytes"], row["choice"], row["best"] = b, choices[j], best
        row["ratio"] = med["auto"] / med["raw"]
        row["raw_busbw"], row["auto_busbw"], row["best_busbw"] = (
            b * f / med[v] / 1e9 for v in ("raw", "auto", best))
    return rows


def tune_results(tables, n) -> dict:
    """{kind: {n: [(bytes, {algorithm: seconds})]}} from the measured tables, for tuning.py."""
    out = {}
    for kind, rows in tables.items():
        out[kind] = {n: [(int(r["bytes"]), {a: float(r[f"{a}_s"]) for a in ALGORITHMS})
                         for r in rows]}
    return out
