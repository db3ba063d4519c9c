"""The shared-memory collectives (``shm.py``): order of reduction, window growth, chunks,
disagreeing ranks, non-blocking serialisation, freeing, and the fallback where ranks span nodes.

Run: mpiexec -n N python tests/mpi/coll_shm.py
"""

import hashlib

import numpy as np
from mpi4py import MPI

from mpipar.mpi import Comm, failfast, shm, tuning
from mpipar.mpi import algorithms as alg

failfast.install()
N = MPI.COMM_WORLD.Get_size()


def make(mode="shm"):
    c = Comm(MPI.COMM_WORLD.Dup(), "dp", world_ranks=list(range(N)))
    c.coll_mode = mode
    return c


def data(seed, r, n, dtype=np.float64):
    return np.random.default_rng([seed, r, n]).uniform(-1.0, 1.0, n).astype(dtype)


def in_rank_order(xs, ufunc=np.add):
    acc = ufunc(xs[0], xs[1])
    for x in xs[2:]:
        acc = ufunc(acc, x)
    return acc


def same_everywhere(c, x, what):
    got = c.gather_bytes(hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest(), trace=False)
    if c.rank == 0:
        assert len(set(got)) == 1, f"{what}: ranks disagree bitwise"


def check_all(c, n, seed, what):
    """Each collective against the rank-order reduction, bit for bit (the shm contract)."""
    p, me = c.size, c.rank
    xs = [data(seed, r, n) for r in range(p)]
    for op, ufunc in (("sum", np.add), ("max", np.maximum)):
        got = c.allreduce(xs[me], op=op)
        assert np.array_equal(got, in_rank_order(xs, ufunc)), f"{what} allreduce {op} n={n}"
        same_everywhere(c, got, f"{what} allreduce {op}")
    k = -(-n // p)
    ys = [data(seed + 1, r, k * p).reshape(p, k) for r in range(p)]
    rs = c.reduce_scatter(ys[me], axis=0)
    assert np.array_equal(rs, in_rank_order(ys)[me:me + 1]), f"{what} reduce_scatter k={k}"
    full = c.allgather(rs, axis=0)
    assert np.array_equal(full, in_rank_order(ys)), f"{what} allgather k={k}"
    # all-reduce and reduce-scatter + all-gather reduce each element in the same order
    flat = c.allreduce(ys[me].reshape(-1))
    assert np.array_equal(flat, full.reshape(-1)), f"{what}: allreduce != reduce_scatter+gather"


def test_growth_and_chunks():
    c = make()
    assert c.shm_offered() and c.algorithm("allreduce", 8) == "shm"
    win = c.windows.shm.window
    assert win.capacity == shm.MIN_BYTES
    for i, n in enumerate((1, N + 1, 1000 * N + 3)):
        check_all(c, n, i, "small")
    assert c.windows.shm.window is win  # fits: the same window
    n = (3 << 20) // 8 + 5  # 3 MiB and a bit of float64: the window grows (on every rank)
    check_all(c, n, 7, "grown")
    assert c.windows.shm.window.capacity == shm.size_class(n * 8) == 4 << 20
    check_all(c, 10, 8, "small after growth")
    c.free()
    # a cap below the message: it goes through the window in chunks (uneven last chunk)
    old, shm.MAX_BYTES = shm.MAX_BYTES, shm.MIN_BYTES
    try:
        c = make()
        check_all(c, (5 << 20) // 8 + 3, 9, "chunked")
        assert c.windows.shm.window.capacity == shm.MIN_BYTES
        x = data(10, c.rank, (3 << 20) // 8 + 1, np.float32)  # 1.5 MiB, non-blocking, chunked
        want = c.allreduce(x)
        req = c.iallreduce(x)
        while not req.done:
            alg.progress()
        assert np.array_equal(req.wait(), want), "chunked iallreduce"
        k = (1 << 20) // 8 * 3 // 2 + 7  # ZeRO-1's all-gather (x is out's block r), chunked
        flat = np.zeros(c.size * k)
        flat[c.rank * k:(c.rank + 1) * k] = data(11, c.rank, k)
        c.allgather(flat[c.rank * k:(c.rank + 1) * k], out=flat)
        want = np.concatenate([data(11, q, k) for q in range(c.size)])
        assert np.array_equal(flat, want), "chunked in-place allgather"
        c.free()
    finally:
        shm.MAX_BYTES = old


def test_disagreeing_ranks_raise_everywhere():
    """A shape that differs between ranks is an error on every rank, never a hang; the
    communicator stays usable."""
    c = make()
    # fits everywhere; too big for the window on rank 1 only (it grows at the post, blocking)
    for n_here in (10 + c.rank, 1000 if c.rank == 0 else (2 << 20) // 8):
        for nonblocking in (False, True):
            x = np.ones(n_here)
            try:
                if nonblocking:
                    req = c.iallreduce(x)
                    while not req.done:
                        alg.progress()
                else:
                    c.allreduce(x)
            except ValueError as exc:
                assert "ranks' calls disagree" in str(exc) and "rank 1:" in str(exc), exc
            else:
                raise AssertionError(f"n={n_here} nonblocking={nonblocking}: no error")
    check_all(c, 100, 11, "after the errors")
    c.free()


def test_nonblocking_in_flight_one_at_a_time():
    c = make()
    # a post that outgrows the window grows it there (blocking, every rank at the same call),
    # never inside a later test() driven by the executor
    x = data(19, c.rank, (3 << 20) // 8)
    want = c.allreduce(x)
    c.free()
    c = make()
    assert c.shm_offered() and c.windows.shm.window.capacity == shm.MIN_BYTES
    req = c.iallreduce(x)
    assert c.windows.shm.window.capacity == 4 << 20, "the window grows at the post"
    assert np.array_equal(req.wait(), want), "iallreduce after growth at the post"
    xs = [data(20 + i, c.rank, 5000 * (i + 1)) for i in range(3)]
    want = [c.allreduce(x) for x in xs]
    reqs = [c.iallreduce(x.copy()) for x in xs]  # each post finishes the one before
    assert reqs[0].test() and reqs[1].test()
    for r, w in zip(reversed(reqs), reversed(want)):
        assert np.array_equal(r.wait(), w), "overlapping iallreduce"
    p, k = c.size, 4096
    x = data(30, c.rank, p * k).reshape(p, k)
    out = np.empty((1, k))
    req = c.ireduce_scatter(x, out)
    assert np.array_equal(req.wait(), c.reduce_scatter(x)), "ireduce_scatter"
    # ZeRO-1's case: the output aliases the input
    buf = data(31, c.rank, p * k)
    want = c.reduce_scatter(buf.reshape(p, k)).reshape(-1)
    c.reduce_scatter(buf.reshape(p, k), out=buf.reshape(p, k)[c.rank:c.rank + 1])
    assert np.array_equal(buf[c.rank * k:(c.rank + 1) * k], want), "aliased reduce_scatter"
    c.free()


def test_not_offered_across_nodes():
    """Where the ranks span nodes, forcing shm runs what auto would choose without it."""
    real = shm.on_one_node
    shm.on_one_node = lambda comm: False
    try:
        c = make()
        assert not c.shm_offered()
        assert c.algorithm("allreduce", 8) == "library"
        # what the defaults choose without shared memory (halves on 2 ranks, else the library;
        # not hier: MPI itself still sees one node here)
        want = tuning.choose("allreduce", 64 << 20, c.size, shm=False, hier=False)
        assert c.algorithm("allreduce", 64 << 20) == want != "shm"
        x = data(40, c.rank, 1000)
        assert np.allclose(c.allreduce(x), c.allreduce(x, op="mean") * c.size)
        c.free()
    finally:
        shm.on_one_node = real


for name, fn in list(globals().items()):
    if name.startswith("test_"):
        fn()
print(f"rank {MPI.COMM_WORLD.Get_rank()} coll_shm OK", flush=True)
