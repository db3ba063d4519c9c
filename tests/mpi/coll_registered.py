"""Registered buffers (``Comm.registered_zeros``, ``shm_registered.py``): the zero-copy shm
all-reduce and reduce-scatter are bitwise the rank-order reduction on every rank, blocking and
overlapped with compute; disagreeing ranks raise on every rank; the window is page-aligned and
never grows for them; plain arrays where shm is not offered.

Run: mpiexec -n N python tests/mpi/coll_registered.py
"""

import hashlib

import numpy as np
from mpi4py import MPI

from mpipar.mpi import Comm, failfast, shm
from mpipar.mpi import algorithms as alg

failfast.install()
N = MPI.COMM_WORLD.Get_size()
SIZES = [0, 1, N - 1, 2 * N + 1, 4099, (3 << 20) // 8 + 5]  # not divisible by p; 0 and 1


def make(mode="shm"):
    c = Comm(MPI.COMM_WORLD.Dup(), "dp", world_ranks=list(range(N)))
    c.coll_mode = mode
    return c


def data(seed, r, n, dtype):
    return np.random.default_rng([seed, r, n]).uniform(-1.0, 1.0, n).astype(dtype)


def in_rank_order(xs):
    acc = xs[0] + xs[1]
    for x in xs[2:]:
        acc = acc + x
    return acc


def same_everywhere(c, x, what):
    got = c.gather_bytes(hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest(), trace=False)
    if c.rank == 0:
        assert len(set(got)) == 1, f"{what}: ranks disagree bitwise"


def test_layout():
    c = make()
    arrays = c.registered_zeros([3, 5000, 0, 7], np.float32)
    assert [a.size for a in arrays] == [3, 5000, 0, 7]
    assert all(a.dtype == np.float32 and not a.any() for a in arrays)
    assert all(a.ctypes.data % 4096 == 0 for a in arrays if a.size), "page-aligned"
    assert all(c._registered(a) for a in arrays if a.size)
    assert c._registered(arrays[1][10:20]) and not c._registered(np.zeros(3, np.float32))
    assert not c._registered(arrays[1][::2]), "a strided view is not a registered buffer"
    assert c._registered(arrays[1].reshape(50, 100)[3]), "a view of a view"
    assert not c._registered(arrays[1].copy()) and not c._registered(arrays[1].tolist())
    assert all(a.base.nbytes == a.nbytes for a in arrays), "each its own bytes (memory.py)"
    c.free()


def test_allreduce_bitwise():
    c = make()
    for dtype in (np.float64, np.float32):
        bufs = c.registered_zeros(SIZES, dtype)
        for i, (buf, n) in enumerate(zip(bufs, SIZES)):
            xs = [data(i, r, n, dtype) for r in range(N)]
            want = in_rank_order(xs) if n else xs[0]
            for op in ("sum", "mean"):
                buf[...] = xs[c.rank]
                got = c.allreduce(buf, op=op, inplace=True)
                assert got is buf
                expect = want / N if op == "mean" else want
                assert np.array_equal(buf, expect), f"allreduce {op} n={n} {dtype.__name__}"
                same_everywhere(c, buf, f"allreduce {op} n={n}")
                buf[...] = xs[c.rank]  # non-blocking, overlapped with compute
                req = c.iallreduce(buf, op=op)
                work = np.ones((64, 64)) @ np.ones((64, 64))
                while not req.test():
                    alg.progress()
                assert req.wait() is buf and work[0, 0] == 64
                assert np.array_equal(buf, expect), f"iallreduce {op} n={n}"
                same_everywhere(c, buf, f"iallreduce {op} n={n}")
    # no copy in: the data window never grew, though a message above its size went through
    assert c.windows.shm.window.capacity == shm.MIN_BYTES
    c.free()


def test_reduce_scatter_bitwise():
    c = make()
    p, r = N, c.rank
    for dtype in (np.float64, np.float32):
        ks = [1, 3, 1000, (3 << 20) // 8 // N + 1]
        bufs = c.registered_zeros([p * k for k in ks], dtype)
        for i, (buf, k) in enumerate(zip(bufs, ks)):
            xs = [data(50 + i, q, p * k, dtype) for q in range(p)]
            want = in_rank_order(xs)[r * k:(r + 1) * k]
            for op in ("sum", "mean"):
                expect = want / p if op == "mean" else want
                buf[...] = xs[r]
                got = c.reduce_scatter(buf.reshape(p, k), op=op)
                assert np.array_equal(got.reshape(-1), expect), f"reduce_scatter {op} k={k}"
                out = np.empty(k, dtype)
                req = c.ireduce_scatter(buf, out, op=op)
                while not req.done:
                    alg.progress()
                assert np.array_equal(req.wait(), expect), f"ireduce_scatter {op} k={k}"
                assert np.array_equal(buf, xs[r]), "the input is left as it was"
                # ZeRO-1's shape with the output inside the input (a registered view)
                c.reduce_scatter(buf.reshape(p, k), op=op, out=buf.reshape(p, k)[r:r + 1])
                assert np.array_equal(buf[r * k:(r + 1) * k], expect), f"aliased k={k}"
            # all-reduce and reduce-scatter reduce each element in the same order
            buf[...] = xs[r]
            c.allreduce(buf, inplace=True)
            assert np.array_equal(buf[r * k:(r + 1) * k], want)
    assert c.windows.shm.window.capacity == shm.MIN_BYTES
    c.free()


def expect_disagreement(c, call, what):
    try:
        call()
    except ValueError as exc:
        assert "ranks' calls disagree" in str(exc) and "rank 1:" in str(exc), exc
        return str(exc)
    raise AssertionError(f"{what}: no error")


def test_disagreeing_ranks_raise_everywhere():
    c = make()
    a, b = c.registered_zeros([1000, 1000], np.float64)
    plain = np.zeros(1000)
    # one rank registered, the other not; the same size at another offset; another size
    mine = {0: (a, plain, a[:500]), 1: (plain, b, a[:499])}
    for i in range(3):
        x = mine.get(c.rank, (a, b, a[:500]))[i]
        for nonblocking in (False, True):
            def call(x=x, nonblocking=nonblocking):
                if nonblocking:
                    req = c.iallreduce(x)
                    while not req.done:
                        alg.progress()
                else:
                    c.allreduce(x, inplace=True)
            msg = expect_disagreement(c, call, f"case {i} nonblocking={nonblocking}")
            if i == 0:
                assert "registered window" in msg and "not a registered buffer" in msg, msg
    expect_disagreement(c, lambda: c.reduce_scatter(
        (a if c.rank == 0 else plain)[:N * 10].reshape(N, 10)), "reduce_scatter")
    try:
        c.registered_zeros([10 + c.rank], np.float64)
    except ValueError as exc:
        assert "asked for different arrays" in str(exc), exc
    else:
        raise AssertionError("registered_zeros with different sizes: no error")
    a[...] = 1.0  # still usable
    c.allreduce(a, inplace=True)
    assert (a == N).all()
    c.free()


def test_auto_and_other_algorithms_on_registered():
    """Every forced algorithm gives the rank-order reduction on a registered buffer; auto
    chooses from the registered rows."""
    n = (1 << 20) // 8 + 3
    for mode in ("auto", "library", "ring", "rabenseifner", "shm"):
        c = make(mode)
        (mine,) = c.registered_zeros([n], np.float64)
        xs = [data(70, q, n, np.float64) for q in range(N)]
        mine[...] = xs[c.rank]
        c.allreduce(mine, inplace=True)
        assert np.allclose(mine, in_rank_order(xs), rtol=0, atol=1e-12), mode
        if mode in ("shm", "auto") and c.algorithm("allreduce_registered", mine.nbytes) == "shm":
            assert np.array_equal(mine, in_rank_order(xs)), mode
        c.free()


def test_buckets_posted_behind_a_late_rank_never_block():
    """Gradient buckets posted back to back (as the backward does) while the last rank is
    still computing: every post returns at once (each starts when the one before it ends), a
    copying shm collective drains them first, and waiting in any order gives each bucket the
    rank-order reduction."""
    import time

    c = make()
    sizes = [5000, 3, 70000, 1, 40001]
    bufs = c.registered_zeros(sizes, np.float64)
    xs = [[data(80 + i, q, n, np.float64) for q in range(N)] for i, n in enumerate(sizes)]
    late = N - 1
    if c.rank == late:
        time.sleep(1.0)  # the others post all their buckets meanwhile
    t0 = time.perf_counter()
    reqs = []
    for i, buf in enumerate(bufs):
        buf[...] = xs[i][c.rank]
        reqs.append(c.iallreduce(buf, op="mean" if i % 2 else "sum"))
    posted = time.perf_counter() - t0
    if c.rank != late:
        assert posted < 0.5, f"posting 5 buckets took {posted:.2f} s: a post waited for a peer"
    plain = data(90, c.rank, 1000, np.float64)  # a copying shm all-reduce: drains the queue
    got = c.allreduce(plain)
    assert np.array_equal(got, in_rank_order([data(90, q, 1000, np.float64) for q in range(N)]))
    assert all(r._req.done for r in reqs), "the copying collective finished the queued first"
    for i in reversed(range(len(bufs))):
        want = in_rank_order(xs[i])
        assert np.array_equal(reqs[i].wait(), want / N if i % 2 else want), f"bucket {i}"
    for i, buf in enumerate(bufs):  # again, waited in order, progressed as the executor does
        buf[...] = xs[i][c.rank]
    reqs = [c.iallreduce(buf) for buf in bufs]
    while not all(r.done for r in reqs):
        alg.progress()
    assert all(np.array_equal(b, in_rank_order(x)) for b, x in zip(bufs, xs, strict=True))
    c.free()


def test_plain_where_one_rank_sees_no_room():
    """A shared-memory file system too small on one rank: every rank gets plain arrays
    (agreed, so no rank waits in a window allocation the others skip), and they still reduce."""
    from mpipar.mpi import windows

    real = windows.room_for
    windows.room_for = lambda nbytes: MPI.COMM_WORLD.Get_rank() != 0
    try:
        plain_and_reduced(1000, lambda c: not c.windows.shm.regs)
    finally:
        windows.room_for = real


def test_plain_where_shm_is_not_offered():
    real = shm.on_one_node
    shm.on_one_node = lambda comm: False
    try:
        plain_and_reduced(10, lambda c: not c.windows.shm)
    finally:
        shm.on_one_node = real


def plain_and_reduced(n, also):
    """registered_zeros gave a plain zeroed array (and ``also(comm)`` holds), which reduces."""
    c = make()
    (x,) = c.registered_zeros([n], np.float64)
    assert not c._registered(x) and isinstance(x, np.ndarray) and not x.any() and also(c)
    x[...] = 1.0
    c.allreduce(x, inplace=True)
    assert (x == N).all()
    c.free()


for name, fn in list(globals().items()):
    if name.startswith("test_"):
        fn()
print(f"rank {MPI.COMM_WORLD.Get_rank()} coll_registered OK", flush=True)
