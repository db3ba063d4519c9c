"""Comm's own Python work per call: each fast path beside the bare call it wraps, with MPI
replaced by a no-op stand-in, so the difference is what ``Comm`` adds (checks, the algorithm
lookup, the trace event, the request object). One process, no mpiexec.

Timed as CPU time of this thread (``time.thread_time``): a loaded machine stretches wall time but
hardly this, so the numbers are usable as indicative even there; the minimum of ``--repeat``
rounds of ``--number`` calls. The stand-in's methods are Python functions, which the raw column
pays as well.

Run: ``python experiments/comm_overhead.py [--untraced] [--number N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpipar.mpi import Comm, load_mpi  # noqa: E402 (mpi4py only through mpipar/mpi)
from mpipar.trace import Tracer  # noqa: E402


class _Req:
    def Wait(self, status=None):  # noqa: N802 (mpi4py's names)
        return None

    def Test(self, status=None):  # noqa: N802
        return True


_REQ = _Req()


class StandIn:
    """The mpi4py communicator methods Comm's fast paths call, doing nothing."""

    def Get_size(self):  # noqa: N802
        return 2

    def Get_rank(self):  # noqa: N802
        return 0

    def Send(self, buf, dest, tag):  # noqa: N802
        return None

    def Recv(self, buf, source, tag, status=None):  # noqa: N802
        return None

    def Isend(self, buf, dest, tag):  # noqa: N802
        return _REQ

    def Irecv(self, buf, source, tag):  # noqa: N802
        return _REQ

    def Allreduce(self, send, recv, op):  # noqa: N802
        return None

    def Reduce_scatter_block(self, send, recv, op):  # noqa: N802
        return None

    def Allgather(self, send, recv):  # noqa: N802
        return None


# (name, raw call, Comm call). A receive of 0 bytes: the stand-in's untouched Status counts 0.
PAIRS = [
    ("send", "mpi.Send([x, BYTE], 1, 5)", "c.send(x, 1, 5)"),
    ("recv (out=)", "mpi.Recv([e, BYTE], 1, 5, st)", "c.recv((0,), np.uint8, 1, 5, out=e)"),
    ("isend + wait", "mpi.Isend([x, BYTE], 1, 5).Wait()", "c.isend(x, 1, 5).wait()"),
    ("irecv + wait (out=)", "mpi.Irecv([e, BYTE], 1, 5).Wait(st)",
     "c.irecv((0,), np.uint8, 1, 5, out=e).wait()"),
    ("allreduce in place", "mpi.Allreduce(IN_PLACE, x, SUM)", "c.allreduce(x, inplace=True)"),
    ("reduce_scatter (out=)", "mpi.Reduce_scatter_block(x, half, SUM)",
     "c.reduce_scatter(x, out=half)"),
    ("allgather (out=)", "mpi.Allgather(x, double)", "c.allgather(x, out=double)"),
]


def measure(traced=True, number=20000, repeat=9) -> list[tuple[str, float, float]]:
    """[(operation, raw seconds per call, Comm seconds per call)]."""
    MPI = load_mpi()
    tracer = Tracer(enabled=traced)
    mpi = StandIn()
    comm = Comm(mpi, "w", tracer, world_ranks=[0, 1])
    names = dict(mpi=mpi, c=comm, np=np, BYTE=MPI.BYTE, IN_PLACE=MPI.IN_PLACE, SUM=MPI.SUM,
                 st=MPI.Status(), x=np.zeros(16, np.float32), half=np.zeros(8, np.float32),
                 double=np.zeros(32, np.float32), e=np.zeros(0, np.uint8))
    rows = []
    for name, raw, call in PAIRS:
        best = {}
        for label, stmt in (("raw", raw), ("comm", call)):
            times = []
            for _ in range(repeat):
                tracer.clear()  # a long event list would bill its growth to the later rounds
                times.append(timeit.timeit(stmt, globals=names, number=number,
                                           timer=time.thread_time) / number)
            best[label] = min(times)
        rows.append((name, best["raw"], best["comm"]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--untraced", action="store_true", help="a disabled tracer (no events)")
    p.add_argument("--number", type=int, default=20000, help="calls per round")
    p.add_argument("--repeat", type=int, default=9, help="rounds (the minimum is reported)")
    a = p.parse_args(argv)
    rows = measure(not a.untraced, a.number, a.repeat)
    print(f"Comm's Python work per call ({'untraced' if a.untraced else 'traced'}; CPU time, "
          f"min of {a.repeat} x {a.number})")
    print(f"{'operation':24s} {'raw ns':>8s} {'Comm ns':>8s} {'added ns':>9s}")
    for name, raw, comm in rows:
        print(f"{name:24s} {raw * 1e9:8.0f} {comm * 1e9:8.0f} {(comm - raw) * 1e9:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
