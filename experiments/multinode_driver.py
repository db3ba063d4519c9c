"""Ping-pong between world ranks 0 and 1 (started by experiments/multinode.py under mpiexec,
2 ranks: on one node, or one on each of two emulated nodes); rank 0 writes the one-way times.

    mpiexec -n 2 python experiments/multinode_driver.py --sizes 1K,1M --json out.json
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpipar.mpi import Comm, load_mpi  # noqa: E402 (mpi4py only through mpipar/mpi)
from mpipar.mpi.bench.sizes import parse_sizes  # noqa: E402

BUDGET_BYTES = 16 << 20  # per size and direction: many repetitions small, at least MIN_REPS big
MIN_REPS, MAX_REPS = 3, 300


def reps_for(nbytes: int, scale: float) -> int:
    return int(max(MIN_REPS, min(MAX_REPS, scale * BUDGET_BYTES // max(nbytes, 1))))


def pingpong(comm: Comm, nbytes: int, reps: int) -> np.ndarray:
    """One-way time of each of `reps` round trips (half the round trip), after one warm-up."""
    x = np.zeros(nbytes, np.uint8)
    times = np.empty(reps)
    peer = 1 - comm.rank
    for i in range(reps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.send(x, peer, 7)
            comm.recv(x.shape, x.dtype, peer, 7, out=x)
        else:
            comm.recv(x.shape, x.dtype, peer, 7, out=x)
            comm.send(x, peer, 7)
        if i:
            times[i - 1] = (time.perf_counter() - t0) / 2
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="experiments/multinode_driver.py")
    ap.add_argument("--sizes", default="1K,4K,16K,64K,256K,1M,4M,16M,64M")
    ap.add_argument("--reps-scale", type=float, default=1.0,
                   help="scale the repetitions per size (default 1: 16 MiB per size, 3-300)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    world = load_mpi().COMM_WORLD
    if world.Get_size() != 2:
        print("multinode_driver.py: run it on exactly 2 ranks", file=sys.stderr)
        return 2
    comm = Comm(world, "world")
    hosts = world.allgather(socket.gethostname())
    rows = []
    for nbytes in parse_sizes(a.sizes):
        t = pingpong(comm, nbytes, reps_for(nbytes, a.reps_scale))
        rows.append({"bytes": nbytes, "reps": len(t), "median_s": float(np.median(t)),
                     "min_s": float(t.min()), "max_s": float(t.max())})
    if comm.rank == 0:
        Path(a.json).write_text(json.dumps({"hosts": hosts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
