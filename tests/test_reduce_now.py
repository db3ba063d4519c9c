"""Asynchronous PipeDream with dp > 1 reduces a micro-batch's gradient of a chunk by its flat
buckets (one collective each, the flushing path's buckets), not parameter by parameter."""

import numpy as np

from mpipar.backend import Backend
from mpipar.mpi import LocalComm
from mpipar.nn.layers import Linear, ParamFactory, Sequential
from mpipar.parallel.data import GradSync
from mpipar.parallel.tensor import TPContext


class RecordingDP(LocalComm):
    """A one-rank communicator that reports dp = 2 and records the arrays it all-reduces."""

    size = 2

    def __init__(self):
        super().__init__("dp")
        self.reduced = []

    def allreduce(self, x, op="sum", inplace=False):
        self.reduced.append((x, op, inplace))
        return super().allreduce(x, op=op, inplace=inplace)


def test_reduce_now_reduces_each_bucket_of_the_chunk_once():
    backend = Backend("cpu", "float64")
    pf = ParamFactory(backend, seed=0)
    chunks = {c: [p for i in range(3) for p in
                  Sequential([Linear(pf, f"c{c}l{i}", 3, 3)], name=f"c{c}u{i}").params()]
              for c in (0, 1)}
    comm = RecordingDP()
    # buckets of two parameters (one linear: weight 9 + bias 3 elements, 12 * 8 bytes)
    sync = GradSync(chunks, comm, backend, TPContext(), bucket_mb=96 / 2**20)
    sync.reduce_now(1)
    buckets = sync.buckets[1]
    assert len(buckets) == 3 and len(comm.reduced) == len(buckets)
    assert all(x is b.grad and op == "mean" and inplace
               for (x, op, inplace), b in zip(comm.reduced, buckets, strict=True))
    # every gradient of the chunk is a view into a reduced bucket: none left out
    assert all(any(np.shares_memory(p.grad, b.grad) for b in buckets) for p in chunks[1])
    assert not any(np.shares_memory(x, p.grad) for x, _, _ in comm.reduced for p in chunks[0])
