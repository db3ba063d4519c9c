"""Every collective algorithm against a NumPy reference, and bitwise equal on every rank.

Run: mpiexec -n N python tests/mpi/coll_algos.py
Awkward sizes (1 element, fewer elements than ranks, not divisible by the rank count), float32
and float64, sum / mean / max; blocking and non-blocking (advanced by ``progress()``).
"""

import hashlib

import numpy as np
from mpi4py import MPI

from mpipar.mpi import Comm, failfast
from mpipar.mpi import algorithms as alg

failfast.install()
world = Comm(MPI.COMM_WORLD.Dup(), "world", world_ranks=list(range(MPI.COMM_WORLD.Get_size())))
p, me = world.size, world.rank
SIZES = sorted({1, 2, p - 1, p + 1, 7, 1000 * p + 3, 65537})


def data(seed, r, n, dtype):
    return np.random.default_rng([seed, r, n]).uniform(0.5, 1.5, n).astype(dtype)


def same_everywhere(x, what):
    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest()
    got = world.gather_bytes(digest, trace=False)
    if me == 0:
        assert len(set(got)) == 1, f"{what}: ranks disagree bitwise"


def close(got, want, what, dtype):
    tol = 1e-5 if dtype == np.float32 else 1e-13
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.max(np.abs(got - want) / np.abs(want)) if want.size else 0.0
    assert err <= tol, f"rank {me} {what}: relative error {err}"


def check_allreduce(algo, n, dtype, op, seed):
    xs = [data(seed, r, n, dtype) for r in range(p)]
    want = np.max(xs, axis=0) if op == "max" else np.sum(np.array(xs, np.float64), axis=0)
    if op == "mean":
        want = want / p
    what = f"{algo} allreduce n={n} {np.dtype(dtype).name} {op}"
    got = world.allreduce(xs[me], op=op)
    close(got, want.astype(dtype), what, dtype)
    same_everywhere(got, what)
    x = xs[me].copy()
    req = world.iallreduce(x, op=op)
    while not req.done:
        alg.progress()
    assert req.wait() is x
    same_everywhere(x, what + " non-blocking")
    # MPI's own non-blocking algorithm may round differently (also where a forced algorithm
    # that cannot run here, hier on one node, fell back on the library)
    if world.algorithm("allreduce", x.nbytes) != "library":
        assert np.array_equal(x, got), f"{what}: non-blocking differs from blocking"


def check_reduce_scatter(algo, k, dtype, seed):
    n = k * p
    xs = [data(seed, r, n, dtype).reshape(p, k) for r in range(p)]
    want = np.sum(np.array(xs, np.float64), axis=0)[me:me + 1]
    got = world.reduce_scatter(xs[me], axis=0)
    close(got, want.astype(dtype), f"{algo} reduce_scatter k={k} {np.dtype(dtype).name}", dtype)
    into = np.full_like(got, np.nan)
    assert world.reduce_scatter(xs[me], out=into) is into and np.array_equal(into, got)
    full = world.allgather(got, axis=0)
    same_everywhere(full, f"{algo} reduce_scatter gathered k={k}")
    out = np.empty_like(got)
    x = xs[me].copy()
    req = world.ireduce_scatter(x, out)
    while not req.done:
        alg.progress()
    assert req.wait() is out, f"{algo} ireduce_scatter k={k}"
    close(out, want.astype(dtype), f"{algo} ireduce_scatter k={k}", dtype)
    if world.algorithm("reduce_scatter", x.nbytes) != "library":  # as in check_allreduce
        assert np.array_equal(out, got), f"{algo} ireduce_scatter k={k} differs from blocking"
    assert np.array_equal(x, xs[me]), f"{algo} ireduce_scatter changed its input"


def check_allgather(algo, k, dtype, seed):
    xs = [data(seed, r, k, dtype).reshape(1, k) for r in range(p)]
    got = world.allgather(xs[me], axis=1)
    assert np.array_equal(got, np.concatenate(xs, axis=1)), f"{algo} allgather k={k}"
    flat = np.zeros(p * k, dtype)  # into out, from a slice of out itself (ZeRO-1's case)
    flat[me * k:(me + 1) * k] = xs[me].reshape(-1)
    assert world.allgather(flat[me * k:(me + 1) * k], out=flat) is flat
    assert np.array_equal(flat, np.concatenate(xs, axis=1).reshape(-1)), f"{algo} out= k={k}"


for algo in alg.ALGORITHMS:
    world.coll_mode = algo
    for i, n in enumerate(s for s in SIZES if s >= 1):
        for dtype in (np.float32, np.float64):
            for op in ("sum", "mean", "max"):
                check_allreduce(algo, n, dtype, op, i)
            check_reduce_scatter(algo, n, dtype, i)
            check_allgather(algo, n, dtype, i)
    # overlapping non-blocking collectives finish independently (distinct tags)
    xs = [data(99, me, n, np.float64) for n in (5, 40000, 3)]
    want = [world.allreduce(x) for x in xs]
    reqs = [world.iallreduce(x.copy()) for x in xs]
    for r, w in zip(reversed(reqs), reversed(want)):
        assert np.array_equal(r.wait(), w), f"{algo}: overlapping iallreduce"
world.free()
print(f"rank {me} coll_algos OK", flush=True)
