"""Every Comm operation along every grid axis against a NumPy reference, on random float64 data.

Run: mpiexec -n N python tests/mpi/comm_ops.py DP PP TP [stage]
With "stage", every transfer goes through the host staging buffers (the path CuPy arrays take
without CUDA-aware MPI), tested here with NumPy arrays.
Each rank can compute every reference itself: rank r's data come from the seed (op, r) only.
"""

import os
import sys

import numpy as np

if len(sys.argv) > 4 and sys.argv[4] == "stage":
    os.environ["MPIPAR_FORCE_STAGING"] = "1"

from mpipar.mpi import LocalComm, MessageSizeError, ProcessGrid, failfast, make_tag  # noqa: E402
from mpipar.mpi.staging import POOL  # noqa: E402
from mpipar.trace import Tracer  # noqa: E402

failfast.install()
dp, pp, tp = (int(a) for a in sys.argv[1:4])
staged = os.environ.get("MPIPAR_FORCE_STAGING") == "1"
tracer = Tracer(enabled=True)
g = ProcessGrid(dp, pp, tp, tracer=tracer)
me = g.rank
RTOL = 1e-14  # positive data: sums of <= 8 terms have no cancellation, only rounding
SHAPE = (8, 16, 24)  # every axis divisible by 1, 2, 4 and 8


def data(op_id, r, shape=SHAPE):
    """Rank r's input for operation op_id: positive, random, never zero."""
    return np.random.default_rng([op_id, r]).uniform(0.5, 1.5, size=shape)


def close(got, want, what):
    err = np.max(np.abs(got - want) / np.abs(want))
    assert got.shape == want.shape, f"rank {me} {what}: shape {got.shape} != {want.shape}"
    assert err <= RTOL, f"rank {me} {what}: relative error {err:.3e} > {RTOL}"


def same_on_all(comm, x, what):
    """Every rank of the group holds bitwise the same array (data parallelism relies on it)."""
    rows = comm.allgather(x.reshape(1, -1))
    assert all(np.array_equal(rows[0], row) for row in rows), f"rank {me} {what}: ranks differ"


def check_collectives(comm, base):
    group = comm.world_ranks
    size = comm.size
    where = f"{comm.axis}(size {size})"
    for k, (op, inplace) in enumerate(
        [("sum", False), ("sum", True), ("mean", False), ("max", True)]
    ):
        oid = base + k
        inputs = [data(oid, r) for r in group]
        want = {"sum": np.sum, "mean": np.mean, "max": np.max}[op](inputs, axis=0)
        x = data(oid, me)
        got = comm.allreduce(x, op=op, inplace=inplace)
        assert (got is x) == (inplace or False), f"{where} allreduce inplace={inplace} identity"
        close(got, want, f"{where} allreduce {op}")
        same_on_all(comm, got, f"{where} allreduce {op}")
    for k, op in enumerate(["sum", "mean"]):
        oid = base + 10 + k
        x = data(oid, me)
        req = comm.iallreduce(x, op=op)
        got = req.wait()
        assert got is x, f"{where} iallreduce must work in place"
        want = np.sum([data(oid, r) for r in group], axis=0) / (size if op == "mean" else 1)
        close(got, want, f"{where} iallreduce {op}")
    for axis in (0, 1, 2, -1):
        oid = base + 20 + axis
        want = np.concatenate([data(oid, r) for r in group], axis=axis)
        got = comm.allgather(data(oid, me), axis=axis)
        assert np.array_equal(got, want), f"rank {me} {where} allgather axis {axis}"
        assert got.flags["C_CONTIGUOUS"], f"{where} allgather result must be contiguous"
        for op in ("sum", "mean"):
            oid = base + 30 + axis
            total = np.sum([data(oid, r) for r in group], axis=0) / (size if op == "mean" else 1)
            want = np.split(total, size, axis=axis)[comm.rank]
            got = comm.reduce_scatter(data(oid, me), axis=axis, op=op)
            close(got, want, f"{where} reduce_scatter {op} axis {axis}")
    check_out_buffers(comm, base + 50, where)
    try:
        comm.reduce_scatter(np.ones((size * 3 + 1, 2)) if size > 1 else np.ones((1, 2)), axis=0)
        assert size == 1, f"{where}: reduce_scatter of a non-divisible axis must raise"
    except ValueError as exc:
        assert "not divisible" in str(exc), str(exc)
    for root in range(size):
        oid = base + 40 + root
        x = data(oid, me)
        got = comm.broadcast(x, root=root)
        assert got is x and np.array_equal(x, data(oid, group[root])), f"{where} bcast {root}"
    got = comm.allreduce_scalar(float(me) + 0.5, op="sum")
    assert got == sum(r + 0.5 for r in group), f"{where} allreduce_scalar {got}"
    got = comm.allreduce_scalar(float(me), op="max")
    assert got == max(group), f"{where} allreduce_scalar max {got}"
    blobs = comm.gather_bytes(b"x" * me + bytes([me]), root=0)
    if comm.rank == 0:
        assert blobs == [b"x" * r + bytes([r]) for r in group], f"{where} gather_bytes {blobs}"
    else:
        assert blobs is None, f"{where} gather_bytes on a non-root must return None"
    comm.barrier()


def check_out_buffers(comm, oid, where):
    """reduce_scatter / allgather into a caller's out (the fast path), into a misfit out (an
    error naming it), and an all-gather whose input is a view of its output (ZeRO-1's case)."""
    size, group = comm.size, comm.world_ranks
    total = np.sum([data(oid, r) for r in group], axis=0)
    out = np.empty((SHAPE[0] // size,) + SHAPE[1:])
    got = comm.reduce_scatter(data(oid, me), out=out)
    assert got is out, f"{where} reduce_scatter(out=) must fill out"
    close(out, np.split(total, size)[comm.rank], f"{where} reduce_scatter into out")
    gout = np.empty((size * SHAPE[0],) + SHAPE[1:])
    assert comm.allgather(data(oid + 1, me), out=gout) is gout, f"{where} allgather(out=)"
    want = np.concatenate([data(oid + 1, r) for r in group])
    assert np.array_equal(gout, want), f"rank {me} {where} allgather into out"
    k = SHAPE[0]
    gout[comm.rank * k:(comm.rank + 1) * k] = data(oid + 2, me)  # ZeRO-1: the shard is a view
    comm.allgather(gout[comm.rank * k:(comm.rank + 1) * k], out=gout)
    assert np.array_equal(gout, np.concatenate([data(oid + 2, r) for r in group])), where
    bad = (SHAPE[0] // size + 1,) + SHAPE[1:]
    for call in (lambda: comm.reduce_scatter(data(oid, me), out=np.empty(bad)),
                 lambda: comm.allgather(data(oid, me), out=np.empty(bad))):
        try:
            call()
            raise AssertionError(f"rank {me} {where}: a misfit out did not raise")
        except ValueError as exc:
            assert "out" in str(exc) and "expected" in str(exc), str(exc)


def check_ring(comm, n_elems):
    """Blocking ring: send to the right, receive from the left (odd ranks receive first)."""
    size, r = comm.size, comm.rank
    if size == 1:
        return
    right, left = (r + 1) % size, (r - 1) % size
    x = data(900 + n_elems, comm.world_ranks[r], (n_elems,))
    tag = make_tag(0, 3, 1)
    if r % 2 == 0:
        comm.send(x, right, tag, mb=3, chunk=1)
        got = comm.recv((n_elems,), np.float64, left, tag, mb=3, chunk=1)
    else:
        got = comm.recv((n_elems,), np.float64, left, tag, mb=3, chunk=1)
        comm.send(x, right, tag, mb=3, chunk=1)
    want = data(900 + n_elems, comm.world_ranks[left], (n_elems,))
    assert np.array_equal(got, want), f"rank {me} {comm.axis} ring of {n_elems}"
    # the same ring again, received into a caller's buffer
    buf = np.empty(n_elems)
    if r % 2 == 0:
        comm.send(x, right, tag)
        got = comm.recv((n_elems,), np.float64, left, tag, out=buf)
    else:
        got = comm.irecv((n_elems,), np.float64, left, tag, out=buf).wait()
        comm.send(x, right, tag)
    assert got is buf and np.array_equal(buf, want), f"rank {me} {comm.axis} ring into out="


def check_nonblocking_ring(comm):
    """Several messages in flight per pair, told apart by tag; receives posted in reverse order."""
    size, r = comm.size, comm.rank
    if size == 1:
        return
    right, left = (r + 1) % size, (r - 1) % size
    mbs = [0, 1, 2, 5]
    sends = [
        comm.isend(data(700 + mb, me, (mb + 3, 7)), right, make_tag(1, mb, 2), mb=mb, chunk=2)
        for mb in mbs
    ]
    recvs = {
        mb: comm.irecv((mb + 3, 7), np.float64, left, make_tag(1, mb, 2), mb=mb, chunk=2)
        for mb in reversed(mbs)
    }
    while not recvs[0].test():
        pass
    for mb in mbs:
        got = recvs[mb].wait()
        want = data(700 + mb, comm.world_ranks[left], (mb + 3, 7))
        assert np.array_equal(got, want), f"rank {me} {comm.axis} irecv mb {mb}"
    for s in sends:
        assert s.wait() is None


# pipeline neighbours as pp_comm ranks (None past either end)
next_rank = g.pp_rank + 1 if g.pp_rank < g.pp_size - 1 else None
prev_rank = g.pp_rank - 1 if g.pp_rank > 0 else None


def check_pipeline(g):
    """Activations forward to the next stage, gradients back to the previous one."""
    act = data(600, me, (5, 6))
    if next_rank is not None:
        g.pp_comm.send(act, next_rank, make_tag(0, 0, 0), mb=0, chunk=0)
    if prev_rank is not None:
        got = g.pp_comm.recv((5, 6), np.float64, prev_rank, make_tag(0, 0, 0), mb=0, chunk=0)
        prev_world = g.pp_comm.world_rank_of(prev_rank)
        assert np.array_equal(got, data(600, prev_world, (5, 6))), f"rank {me} activation"
        g.pp_comm.send(got * 2.0, prev_rank, make_tag(1, 0, 0), mb=0, chunk=0)
    if next_rank is not None:
        got = g.pp_comm.recv((5, 6), np.float64, next_rank, make_tag(1, 0, 0), mb=0, chunk=0)
        assert np.array_equal(got, act * 2.0), f"rank {me} gradient"


def check_size_errors(comm):
    """A receive whose shape/dtype disagrees with the send raises MessageSizeError."""
    if comm.size < 2 or comm.rank > 1:
        return
    tag = make_tag(0, 7, 0)
    # an F-ordered (transposed) array would go out in memory order: refused before any traffic
    # (forced staging copies it to a C-ordered host buffer first, so it is fine there)
    for send in (comm.send, comm.isend) if comm.staging is not True else ():
        try:
            send(np.ones((3, 4)).T, 1 - comm.rank, tag)
            raise AssertionError(f"rank {me}: an F-ordered send did not raise")
        except ValueError as exc:
            assert "C-contiguous" in str(exc), str(exc)
    if comm.rank == 0:
        comm.send(np.ones(10, dtype=np.float32), 1, tag)  # 40 bytes; rank 1 expects 80
        comm.send(np.ones(20), 1, tag)  # 160 bytes; rank 1 expects 80
        comm.isend(np.ones(3), 1, tag).wait()  # 24 bytes; rank 1 expects 80
        for n in (5, 20, 3):  # the same into the receiver's own buffer (the fast path)
            comm.send(np.ones(n), 1, tag)
    else:
        for expect in ("expected 80 bytes", "larger than the expected 80"):
            try:
                comm.recv((10,), np.float64, 0, tag)
                raise AssertionError(f"rank {me}: mismatched recv did not raise")
            except MessageSizeError as exc:
                assert expect in str(exc) and "disagree" in str(exc), str(exc)
        req = comm.irecv((10,), np.float64, 0, tag)
        try:
            req.wait()
            raise AssertionError(f"rank {me}: mismatched irecv did not raise")
        except MessageSizeError as exc:
            assert "expected 80 bytes" in str(exc), str(exc)
        buf = np.empty(10)
        for expect in ("expected 80 bytes", "larger than the expected 80"):
            try:
                comm.recv((10,), np.float64, 0, tag, out=buf)
                raise AssertionError(f"rank {me}: mismatched recv(out=) did not raise")
            except MessageSizeError as exc:
                assert expect in str(exc) and "disagree" in str(exc), str(exc)
        req = comm.irecv((10,), np.float64, 0, tag, out=buf)
        try:
            while not req.test():
                pass
            raise AssertionError(f"rank {me}: mismatched irecv(out=) did not raise")
        except MessageSizeError as exc:
            assert "expected 80 bytes" in str(exc), str(exc)
        try:
            comm.recv((5,), np.float64, 0, tag, out=buf)
            raise AssertionError(f"rank {me}: a misfit out did not raise")
        except ValueError as exc:
            assert "out has shape (10,)" in str(exc), str(exc)


base = 0
for comm in (g.tp_comm, g.pp_comm, g.dp_comm, g.world_comm):
    # one representation of a one-rank axis: a LocalComm, never None or a size-1 Comm
    assert isinstance(comm, LocalComm) == (comm.size == 1), f"{comm.axis}: {type(comm)}"
    check_collectives(comm, base)
    base += 100
    for n_elems in (13, 300_000):  # below and above the eager limit
        check_ring(comm, n_elems)
    check_nonblocking_ring(comm)
check_pipeline(g)
check_size_errors(g.world_comm)

# trace events: every op recorded with its axis, bytes and peer; size-1 groups record nothing
ev = tracer.events()
kinds = {k.decode() for k in ev["kind"]}
for comm in (g.tp_comm, g.pp_comm, g.dp_comm, g.world_comm):
    ops = ("allreduce", "allgather", "reduce_scatter", "broadcast", "gather", "barrier")
    if comm.size > 1:
        ops += ("send", "recv", "wait")
    for op in ops:
        present = f"{comm.axis}.{op}" in kinds
        assert present == (comm.size > 1), f"rank {me}: event {comm.axis}.{op} present={present}"
if next_rank is not None:
    sends = ev[(ev["kind"] == b"pp.send") & (ev["mb"] == 0) & (ev["chunk"] == 0)]
    peer = g.pp_comm.world_rank_of(next_rank)
    assert len(sends) >= 1 and sends[-1]["peer"] == peer and sends[-1]["bytes"] == 240, sends
waits = ev[(ev["kind"] == b"world.wait") & (ev["chunk"] == 2)]  # the non-blocking ring
if g.world_size > 1:
    assert sorted(waits["mb"]) == [0, 0, 1, 1, 2, 2, 5, 5], waits  # 4 sends + 4 receives
    assert len(ev[(ev["kind"] == b"world.wait") & (ev["chunk"] == -1)]) >= 2, "iallreduce waits"
assert np.all(ev["end"] >= ev["start"]), "event ends before it starts"
assert (POOL.allocated > 0) == staged, f"staging pool used={POOL.allocated}"
if staged:
    assert POOL.allocated < 40, f"staging buffers not reused: {POOL.allocated}"
g.free()
if me == 0:
    print(f"comm_ops OK: dp={dp} pp={pp} tp={tp} staged={staged}, {len(ev)} events on rank 0")
