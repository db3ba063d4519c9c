"""The fixed-cost paths of a small model's step keep their guarantees: the buffer pool hands out
only free buffers (and leaves small arrays to malloc), a gradient bucket starts once every one of
its parameters is final, and zeroing by bucket zeroes every gradient."""

import numpy as np

from mpipar.backend import Backend
from mpipar.mpi import LocalComm
from mpipar.nn import cpu
from mpipar.nn.layers import Linear, ParamFactory, Sequential
from mpipar.parallel.data import GradSync
from mpipar.parallel.tensor import TPContext


def test_small_arrays_skip_the_pool_and_large_ones_reuse_only_free_buffers():
    cpu.clear_pool()
    small = cpu.empty(np, (4, 4), np.float32)
    assert small.nbytes < cpu.POOL_MIN_BYTES and not cpu._pool
    shape = (256, 128)  # 128 KiB of float32: pooled
    a, b = cpu.empty(np, shape, np.float32), cpu.empty(np, shape, np.float32)
    assert a is not b
    held = b
    del a
    c = cpu.empty(np, shape, np.float32)  # a was freed: handed out again, never b
    assert c is not held and len(cpu._pool[(shape, "<f4")]) == 2
    d = cpu.empty(np, shape, np.float32)  # both held: a new one
    assert d is not held and d is not c
    cpu.clear_pool()


class FakeDP(LocalComm):
    """A one-rank communicator that reports dp = 2, so GradSync overlaps its buckets; records
    which buckets it is asked to reduce."""

    size = 2

    def __init__(self):
        super().__init__("dp")
        self.started = []

    def iallreduce(self, x, op="sum"):
        self.started.append(x)
        return super().iallreduce(x, op=op)


def test_a_bucket_starts_when_its_last_parameter_is_final():
    backend = Backend("cpu", "float64")
    pf = ParamFactory(backend, seed=0)
    units = [Sequential([Linear(pf, f"l{i}", 3, 3)], name=f"u{i}") for i in range(3)]
    params = [p for u in units for p in u.params()]
    comm = FakeDP()
    # buckets of two parameters (one linear: weight 9 + bias 3 elements, 12 * 8 bytes)
    sync = GradSync({0: params}, comm, backend, TPContext(), bucket_mb=96 / 2**20)
    assert [len(b.params) for b in sync.buckets[0]] == [2, 2, 2]
    for _step in range(2):  # the count-down starts afresh each step
        for p in params:
            p.grad[...] = 1.0
        sync.zero_grads(params)
        assert all(not p.grad.any() for p in params)
        sync.start()
        comm.started.clear()
        for k, unit in enumerate(reversed(units)):  # backward order
            sync.unit_ready(0, unit)
            assert len(comm.started) == k + 1
        sync.unit_ready(0, units[0])  # reported twice: nothing new starts
        assert len(comm.started) == 3
        sync.finish()
