"""Comm with CuPy arrays (needs a GPU): every op against a NumPy reference, float64.

Run: mpiexec -n N python tests/mpi/comm_gpu.py
Uses whichever path this MPI supports (CUDA-aware or staged through pinned host buffers);
MPIPAR_CUDA_AWARE=0 forces staging. Ranks may share one GPU.
"""

import cupy as cp
import numpy as np

from mpipar.backend import Backend
from mpipar.mpi import ProcessGrid, bind_gpu, failfast, make_tag
from mpipar.mpi import staging as staging_mod
from mpipar.trace import Tracer

failfast.install()
device = bind_gpu()
backend = Backend("cuda", "float64")
tracer = Tracer(backend=backend)
from mpi4py import MPI  # noqa: E402

n = MPI.COMM_WORLD.Get_size()
g = ProcessGrid(n, 1, 1, tracer=tracer, backend=backend)
c, me = g.dp_comm, g.rank
SHAPE = (4, 2 * n, 6)


def data(op, r):
    return np.random.default_rng([op, r]).uniform(0.5, 1.5, SHAPE)


def close(got, want, what):
    assert isinstance(got, cp.ndarray), f"{what}: result is {type(got)}, not a CuPy array"
    got = got.get()
    err = np.max(np.abs(got - want) / np.abs(want))
    assert err <= 1e-14, f"rank {me} {what}: relative error {err:.3e}"


ranks = range(n)
x = cp.asarray(data(1, me))
close(c.allreduce(x), np.sum([data(1, r) for r in ranks], axis=0), "allreduce")
y = c.allreduce(x, op="mean", inplace=True)
assert y is x
close(x, np.mean([data(1, r) for r in ranks], axis=0), "allreduce mean inplace")
x = cp.asarray(data(2, me))
close(c.iallreduce(x).wait(), np.sum([data(2, r) for r in ranks], axis=0), "iallreduce")
close(c.allgather(cp.asarray(data(3, me)), axis=1),
      np.concatenate([data(3, r) for r in ranks], axis=1), "allgather axis 1")
total = np.sum([data(4, r) for r in ranks], axis=0)
close(c.reduce_scatter(cp.asarray(data(4, me)), axis=1),
      np.split(total, n, axis=1)[me], "reduce_scatter axis 1")
x = cp.asarray(data(5, me))
close(c.broadcast(x, root=n - 1), data(5, n - 1), "broadcast")
# ring, blocking and non-blocking, with a kernel still queued on the stream before the send
right, left = (me + 1) % n, (me - 1) % n
big = cp.asarray(data(6, me))
big = big * 2.0  # queued work the send must wait for
req = c.irecv(SHAPE, np.float64, left, make_tag(0, 1, 0), xp=cp)
c.isend(big, right, make_tag(0, 1, 0)).wait()
close(req.wait(), data(6, left) * 2.0, "isend/irecv ring")
if me % 2 == 0:
    c.send(big, right, make_tag(1, 2, 0))
    got = c.recv(SHAPE, np.float64, left, make_tag(1, 2, 0), xp=cp)
else:
    got = c.recv(SHAPE, np.float64, left, make_tag(1, 2, 0), xp=cp)
    c.send(big, right, make_tag(1, 2, 0))
close(got, data(6, left) * 2.0, "send/recv ring")
kinds = {k.decode() for k in tracer.events()["kind"]}
assert {"dp.allreduce", "dp.send", "dp.recv", "dp.wait"} <= kinds, kinds
if me == 0:
    print(f"comm_gpu OK on {n} ranks, device {device}, cuda_aware={staging_mod.cuda_aware()}, "
          f"staging buffers allocated={staging_mod.POOL.allocated}")
