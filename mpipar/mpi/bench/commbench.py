"""Communication benchmark: mpipar's ``Comm`` beside raw mpi4py, in the same run.

Point-to-point ping-pong between world ranks 0 and 1 (one-way time and bandwidth; ``Comm``
receives into a reused buffer, as the pipeline's receive pool does), and all-reduce,
reduce-scatter and all-gather over all ranks with every algorithm (``collbench.py``: time,
algorithm chosen, bus bandwidth), for message sizes from bytes to 64 MiB. ``--tune`` writes the
fastest algorithm per kind and size to the table ``Comm`` chooses from (``tuning.py``); the
tables and files are ``report.py``'s.
Each iteration runs the raw probe and the ``Comm`` paths back to back, in a random order (the
same on every rank), each as ``reps_for(bytes)`` operations in a row (64 up to 4 KiB, one from
256 KiB: a lone small operation is no longer than the clock calls and barrier skew around it),
and the tables report medians of the per-operation time: shared-memory bandwidth on a small
machine drifts for minutes at a time (BENCHMARKS.md), so only a side-by-side ratio means anything.

An operation's time is the slowest rank's (collectives) or half the round trip seen by rank 0
(ping-pong). Raw and ``Comm`` use the same buffers the same way (a send buffer and a separate,
reused receive buffer), and ``Comm`` traces every operation, as in a run; the ping-pong also
runs through a second ``Comm`` whose tracer is off (``run.trace = false``), so the trace
event's share of ``Comm``'s cost is measured, not guessed. Bus bandwidth follows
nccl-tests: algbw * 2 (n-1) / n for all-reduce, (n-1) / n for reduce-scatter and all-gather.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import time
from pathlib import Path

import numpy as np

from mpipar.files import check_writable
from mpipar.mpi import tuning
from mpipar.mpi.algorithms import KINDS
from mpipar.mpi.bench.collbench import VARIANTS, bench_kind, elements, reps_for, tune_results
from mpipar.mpi.comm import Comm
from mpipar.mpi.grid import bind_gpu
from mpipar.mpi.hierarchical import node_index, topology
from mpipar.mpi.job.world import library_version
from mpipar.mpi.staging import cuda_aware
from mpipar.trace import Tracer

RESULT_DTYPE = np.dtype(
    [
        ("bytes", "i8"),
        ("raw_s", "f8"),  # median time of one operation, raw mpi4py
        ("comm_s", "f8"),  # the same through mpipar's Comm
        ("ratio", "f8"),  # comm_s / raw_s
        ("raw_gbps", "f8"),  # bandwidth, GB/s (1e9 bytes/s): p2p one-way, all-reduce bus bw
        ("comm_gbps", "f8"),
    ]
)


def _pingpong(comms, mpi_comm, MPI, size, iters, warmup, xp, raw_xp):
    """Per-iteration one-way times seen by rank 0, (raw, [one array per Comm of ``comms``]);
    None on other ranks. ``comms``: the traced Comm, then an untraced one (``run.trace =
    false``): the difference between the two is the trace event's cost."""
    rank = mpi_comm.Get_rank()
    # raw and Comm move the same bytes between the same buffers: a send buffer and a separate,
    # reused receive buffer on rank 0; rank 1 sends back what it received. The same memory for
    # both, so a difference between the columns is Comm's own work, not where pages landed
    raw_buf, raw_in = raw_xp.ones(size, dtype=np.uint8), raw_xp.ones(size, dtype=np.uint8)
    same = raw_xp is xp
    comm_buf = raw_buf if same else xp.ones(size, dtype=np.uint8)
    comm_in = raw_in if same else xp.ones(size, dtype=np.uint8)
    u8 = np.dtype(np.uint8)  # a dtype object, as the pipeline passes its activations' dtype
    tag = 11
    reps = range(reps_for(size))
    per = 2 * len(reps)  # one-way messages per sample

    def raw_once():
        if rank == 0:
            t = time.perf_counter()
            for _ in reps:
                mpi_comm.Send([raw_buf, MPI.BYTE], 1, tag)
                mpi_comm.Recv([raw_in, MPI.BYTE], 1, tag)
            return (time.perf_counter() - t) / per
        for _ in reps:
            mpi_comm.Recv([raw_in, MPI.BYTE], 0, tag)
            mpi_comm.Send([raw_in, MPI.BYTE], 0, tag)
        return 0.0

    def comm_once(world):
        if rank == 0:
            t = time.perf_counter()
            for _ in reps:
                world.send(comm_buf, 1, tag)
                world.recv((size,), u8, 1, tag, xp=xp, out=comm_in)
            return (time.perf_counter() - t) / per
        for _ in reps:
            got = world.recv((size,), u8, 0, tag, xp=xp, out=comm_in)
            world.send(got, 0, tag)
        return 0.0

    if rank > 1:
        return None  # only world ranks 0 and 1 play; the others wait at the next barrier
    runs = [raw_once] + [lambda w=w: comm_once(w) for w in comms]
    times = np.zeros((len(runs), warmup + iters))
    rng = np.random.default_rng(size)  # the same orders on both ranks; not one fixed rotation
    for i in range(warmup + iters):
        for k in rng.permutation(len(runs)):
            times[k, i] = runs[k]()
    return (times[0, warmup:], list(times[1:, warmup:])) if rank == 0 else None


def preflight(out=None, table=None) -> tuple[int, str]:
    """(world rank, why the benchmark cannot run or ""), the same verdict on every rank.

    Collective. Needs 2 or more ranks; when ``out`` (the HDF5 result) or ``table`` (--tune's
    JSON) is given, world rank 0 checks that it can be written there and tells every rank (so all
    stop together).
    """
    from mpi4py import MPI

    n, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    if n < 2:
        return rank, "needs at least 2 ranks: mpiexec -n 2 mpipar commbench"
    error = ""
    if rank == 0 and out:
        try:
            check_writable(out)
        except ValueError as exc:
            error = str(exc).replace("timing dump", "benchmark result")
    if rank == 0 and table and not error:
        error = _check_table_path(table)
    world = Comm(MPI.COMM_WORLD.Dup(), "world", world_ranks=list(range(n)))
    try:
        error = world.broadcast_bytes(error.encode() if rank == 0 else None, trace=False).decode()
    finally:
        world.free()
    return rank, error


def _check_table_path(path) -> str:
    """Why --tune cannot write its table at ``path`` ("" when it can)."""
    parent = Path(path).resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        return f"cannot write the collectives table {path}: choose another --table"
    return ""


def run_benchmark(sizes, iters=20, warmup=2, device="cpu", staging=None, tracer=None,
                  kinds=KINDS):
    """Run the benchmarks on every rank of COMM_WORLD; rank 0 gets the result dict, others None.

    Result: {"p2p": RESULT_DTYPE rows (Comm traced), "p2p_untraced" (its tracer off),
    "p2p_samples": (raw, comm) arrays [sizes, iters],
    "collectives": {kind: COLL_DTYPE rows}, "collective_samples": {kind: [variant, size, iter]}
    (kinds: those asked for, and ``allreduce_registered`` / ``reduce_scatter_registered``: the
    same on a registered buffer, where the ranks share a node and the device is the CPU),
    "allreduce": RESULT_DTYPE rows (raw beside auto, for ``mpipar bench``), "attrs": {...}}.
    """
    from mpi4py import MPI

    if iters < 1 or warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    mpi_comm = MPI.COMM_WORLD.Dup()
    n = mpi_comm.Get_size()
    if n < 2:
        raise ValueError("commbench needs at least 2 ranks: run mpiexec -n 2 mpipar commbench")
    # the job's topology, recorded with the table; a table tuned on another is not applied
    topo = topology(node_index(mpi_comm))
    tuning.use_topology(topo, mpi_comm.Get_rank())
    tracer = tracer if tracer is not None else Tracer(enabled=True)
    world = Comm(mpi_comm, "world", tracer, world_ranks=list(range(n)), staging=staging)
    xp = np
    if device == "cuda":
        import cupy

        bind_gpu()
        xp = cupy
    # the raw probe hands device memory to MPI only when MPI can take it; else host memory,
    # the best MPI itself can do, so the ratio shows the cost of staging
    raw_xp = xp if (device == "cuda" and cuda_aware()) else np

    # the same messages through a Comm whose tracer is off (run.trace = false)
    quiet = Comm(mpi_comm.Dup(), "world", Tracer(enabled=False), world_ranks=list(range(n)),
                 staging=staging)
    p2p_raw, p2p_comm, p2p_quiet = [], [], []
    for size in sizes:
        res = _pingpong([world, quiet], mpi_comm, MPI, size, iters, warmup, xp, raw_xp)
        if res is not None:
            p2p_raw.append(res[0])
            p2p_comm.append(res[1][0])
            p2p_quiet.append(res[1][1])
        mpi_comm.Barrier()
    quiet.free()
    colls, coll_samples = {}, {}
    for kind in kinds:
        colls[kind], coll_samples[kind] = bench_kind(kind, world, mpi_comm, MPI, sizes, iters,
                                                     warmup, xp, raw_xp)
    # the same on one registered buffer (host memory, ranks of one node): "<kind>_registered"
    reg_kinds = [k for k in kinds if k in tuning.REGISTERED] if device == "cpu" else []
    if reg_kinds and world.shm_offered():
        (reg,) = world.registered_zeros(
            [max(elements(k, s, n) for k in reg_kinds for s in sizes)], np.float32)
        for kind in reg_kinds:
            name = tuning.REGISTERED[kind]
            colls[name], coll_samples[name] = bench_kind(kind, world, mpi_comm, MPI, sizes,
                                                         iters, warmup, xp, raw_xp, reg)
    blobs = world.gather_bytes(socket.gethostname().encode(), root=0, trace=False)
    hosts = [b.decode() for b in blobs] if blobs is not None else None
    world.free()  # and mpi_comm with it
    if MPI.COMM_WORLD.Get_rank() != 0:
        return None

    def table(raw, comm, nbytes, bw_factor):
        rows = np.zeros(len(nbytes), dtype=RESULT_DTYPE)
        for i, b in enumerate(nbytes):
            r, c = float(np.median(raw[i])), float(np.median(comm[i]))
            rows[i] = (b, r, c, c / r, b * bw_factor / r / 1e9, b * bw_factor / c / 1e9)
        return rows

    return {
        "p2p": table(p2p_raw, p2p_comm, sizes, 1.0),
        "p2p_untraced": table(p2p_raw, p2p_quiet, sizes, 1.0),
        "p2p_samples": (np.array(p2p_raw), np.array(p2p_comm)),
        "collectives": colls,
        "collective_samples": coll_samples,
        "allreduce": _raw_vs_auto(colls["allreduce"]) if "allreduce" in colls else None,
        "tuned": tuning.tuned_table(tune_results(colls, n), library_version(), topo),
        "attrs": {
            "world_size": n,
            "hostnames": hosts,
            "topology": topo,
            "iters": iters,
            "warmup": warmup,
            "device": device,
            "staging": {None: "auto", True: "on", False: "off"}[staging],
            "cuda_aware": bool(cuda_aware()) if device == "cuda" else False,
            "mpi_library": library_version(),
            "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "collectives_mode": tuning.mode(),
            "collectives_table": _table_source(),
            "variants": list(VARIANTS),
        },
    }


def _raw_vs_auto(rows):
    out = np.zeros(len(rows), dtype=RESULT_DTYPE)
    for i, r in enumerate(rows):
        out[i] = (r["bytes"], r["raw_s"], r["auto_s"], r["ratio"], r["raw_busbw"],
                  r["auto_busbw"])
    return out


def _table_source() -> str:
    """Where ``auto``'s choices came from: the table file, or the built-in defaults."""
    path = os.environ.get(tuning.ENV_TABLE, "").strip()
    if path:
        return path
    p = tuning.default_path()
    return str(p) if p.is_file() else "built-in defaults"
