"""The node-aware collectives (``hierarchical.py``) on ranks MPI sees on two or more nodes.

Run on one machine made to look like two nodes:
    mpiexec -n 4 -launcher fork -hosts nodeA:2,nodeB:2 python tests/mpi/coll_hier.py
(``-hosts nodeA:1,nodeB:1``: ranks alternate between the nodes, so the node's blocks are not
contiguous). Prints "coll_hier OK" per rank.
"""

import hashlib

import numpy as np
from mpi4py import MPI

from mpipar.mpi import Comm, algorithms, failfast, hierarchical

failfast.install()
W = MPI.COMM_WORLD
N, R = W.Get_size(), W.Get_rank()
NODE_OF = hierarchical.node_index(W)
assert max(NODE_OF) >= 1, f"rank {R}: MPI sees one node ({NODE_OF}): launch with -hosts a,b"


def make(mode):
    c = Comm(W.Dup(), "dp", world_ranks=list(range(N)))
    c.coll_mode = mode
    return c


def data(seed, r, n, dtype):
    return np.random.default_rng([seed, r, n]).uniform(-1.0, 1.0, n).astype(dtype)


def same_everywhere(c, x, what):
    got = c.gather_bytes(hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest(), trace=False)
    if c.rank == 0:
        assert len(set(got)) == 1, f"{what}: ranks disagree bitwise"


def flat_sum(seed, n, dtype):
    """Every rank's input summed in float64 (the reference, within rounding)."""
    return sum(data(seed, q, n, dtype).astype(np.float64) for q in range(N))


def tol(dtype):
    return 1e-12 if dtype == np.float64 else 1e-5


c = make("hier")
assert c.windows.hier_offered() and c.algorithm("allreduce", 8) == "hier"
assert c.algorithm("allgather", 1 << 20) != "hier"  # only all-reduce and reduce-scatter
hier = c.windows.hier
assert hier.nodes == max(NODE_OF) + 1 and hier.node_of == NODE_OF
# two nodes with as many ranks each: every rank exchanges its slice with its pair
counts = [NODE_OF.count(j) for j in range(hier.nodes)]
assert hier.paired == (len(counts) == 2 and counts[0] == counts[1]), (hier.paired, NODE_OF)


def node_sums_added(seed, n, dtype, op=np.add):
    """The two-node result bit for bit: each node's inputs reduced in rank order, then the
    two node sums (what every element goes through, on either path)."""
    sums = []
    for j in range(2):
        members = [q for q in range(N) if NODE_OF[q] == j]
        acc = data(seed, members[0], n, dtype)
        for q in members[1:]:
            acc = op(acc, data(seed, q, n, dtype))
        sums.append(acc)
    return op(sums[0], sums[1])


# all-reduce: blocking, in place and not, several sizes (odd ones, fewer elements than ranks)
for dtype in (np.float64, np.float32):
    for n in (1, 3, 7, 1000, 4099, 300_001):
        x = data(1, R, n, dtype)
        got = c.allreduce(x)
        same_everywhere(c, got, f"allreduce {n} {dtype.__name__}")
        np.testing.assert_allclose(got, flat_sum(1, n, dtype), rtol=tol(dtype), atol=tol(dtype))
        if hier.nodes == 2:
            assert np.array_equal(got, node_sums_added(1, n, dtype)), f"allreduce {n} bits"
        y = x.copy()
        assert c.allreduce(y, inplace=True) is y and np.array_equal(y, got)
        m = c.allreduce(x, op="max")
        assert np.array_equal(m, np.max([data(1, q, n, dtype) for q in range(N)], axis=0))
        assert np.allclose(c.allreduce(x, op="mean"), got / N)

# reduce-scatter: rank r's block of the sum, sizes divisible by the ranks
for dtype in (np.float64, np.float32):
    for k in (1, 5, 1001, 70_001):
        x = data(2, R, N * k, dtype)
        out = c.reduce_scatter(x)
        ref = flat_sum(2, N * k, dtype)[R * k:(R + 1) * k]
        np.testing.assert_allclose(out, ref, rtol=tol(dtype), atol=tol(dtype))
        if hier.nodes == 2:
            bits = node_sums_added(2, N * k, dtype)[R * k:(R + 1) * k]
            assert np.array_equal(out, bits), f"reduce_scatter {k} bits"
        whole = c.allgather(out)
        same_everywhere(c, whole, f"reduce_scatter {k}")
        x2 = x.reshape(N * k, 1).copy()
        assert np.array_equal(c.reduce_scatter(x2).reshape(-1), out)
        into = np.empty(k, dtype)
        assert c.reduce_scatter(x, out=into) is into and np.array_equal(into, out)

# non-blocking: several buckets in flight, advanced by progress(), waited out of order
reqs, xs = [], []
for i, n in enumerate((10, 5000, 123_457, 64)):
    xs.append(data(3 + i, R, n, np.float64))
    reqs.append(c.iallreduce(xs[-1]))
    algorithms.progress()
for i in (2, 0, 3, 1):
    got = reqs[i].wait()
    same_everywhere(c, got, f"iallreduce {i}")
    np.testing.assert_allclose(got, flat_sum(3 + i, got.size, np.float64), rtol=1e-12)
k = 999
x = data(9, R, N * k, np.float64)
out = np.empty(k)
req = c.ireduce_scatter(x, out)
ar = c.iallreduce(data(10, R, 77, np.float64))
assert req.wait() is out
np.testing.assert_allclose(out, flat_sum(9, N * k, np.float64)[R * k:(R + 1) * k], rtol=1e-12)
same_everywhere(c, ar.wait(), "iallreduce after ireduce_scatter")

# bigger than the node window's first size (1 MiB per rank): the window grows at the post
big = data(11, R, 3 << 18, np.float64)  # 6 MiB
got = c.iallreduce(big.copy()).wait()
same_everywhere(c, got, "6 MiB iallreduce")
if hier.nodes == 2:  # several pieces on the link at once, the last one short
    assert np.array_equal(got, node_sums_added(11, big.size, np.float64)), "6 MiB bits"
np.testing.assert_allclose(got, flat_sum(11, big.size, np.float64), rtol=1e-12)

# registered buffers (the dp buckets): each node's ranks share a window, reduced there in place
n0, k1 = 200_003, 1001
regs = c.registered_zeros([n0, N * k1], np.float64)
assert c.windows.reg_shm is hier.shm and all(c._registered(r) for r in regs)
assert c.algorithm_for("allreduce", 8, regs[0], registered=True) == "hier"
x0, x1 = data(20, R, n0, np.float64), data(21, R, N * k1, np.float64)
want0, want1 = c.allreduce(x0), c.reduce_scatter(x1)  # the copying path
regs[0][:] = x0
assert c.allreduce(regs[0], inplace=True) is regs[0] and np.array_equal(regs[0], want0)
regs[1][:] = x1
assert np.array_equal(c.reduce_scatter(regs[1]), want1)
for _ in range(2):  # posted back to back (the second queued behind the first), as buckets are
    regs[0][:], regs[1][:] = x0, x1
    out1 = np.empty(k1)
    r0, r1 = c.iallreduce(regs[0]), c.ireduce_scatter(regs[1], out1)
    r2 = c.iallreduce(regs[1][:5])  # a view inside a registered buffer, after the others
    algorithms.progress()
    assert r1.wait() is out1 and np.array_equal(out1, want1)
    assert r0.wait() is regs[0] and np.array_equal(regs[0], want0)
    same_everywhere(c, r2.wait(), "registered view")

# auto: the defaults pick hier for large messages here, the library for small ones
a = make("auto")
assert a.algorithm("allreduce", 64) == "library"
assert a.algorithm("allreduce", 16 << 20) == "hier", a.algorithm("allreduce", 16 << 20)
assert a.algorithm("reduce_scatter", 16 << 20) == "hier"
assert a.algorithm("allgather", 16 << 20) == "library"
assert a.algorithm("allreduce_registered", 16 << 20) == "hier"
assert not a.shm_offered()  # spans nodes: no whole-group window

# a sub-communicator inside one node: shm, not hier; one rank per node: neither
node_mates = W.Split(NODE_OF[R], R)
if node_mates.Get_size() > 1:
    s = Comm(node_mates, "tp", world_ranks=[q for q in range(N) if NODE_OF[q] == NODE_OF[R]])
    s.coll_mode = "hier"
    assert s.algorithm("allreduce", 16 << 20) != "hier" and s.shm_offered()
    s.free()
else:
    node_mates.Free()
lead = R == NODE_OF.index(NODE_OF[R])  # the node's lowest rank: one per node
leaders = W.Split(0 if lead else 1, R)
if lead:
    f = Comm(leaders, "pp", world_ranks=[q for q in range(N) if q == NODE_OF.index(NODE_OF[q])])
    f.coll_mode = "hier"
    assert f.algorithm("allreduce", 16 << 20) != "hier"  # one rank per node: nothing inside
    f.free()
else:
    leaders.Free()

a.free()
c.free()

# the grid: MPI's nodes, the topology, the placement lines (grid and tp warning)
from mpipar.mpi import ProcessGrid, tuning  # noqa: E402

if N == 4:
    for order in ("tp-dp-pp", "dp-tp-pp"):
        g = ProcessGrid(2, 1, 2, order=order)
        assert g.node_of == NODE_OF and g.topology["nodes"] == max(NODE_OF) + 1
        assert tuning._TOPOLOGY[0] == g.topology
        lines = g.placement()
        spans = len({NODE_OF[q] for q in g.tp_comm.world_ranks}) > 1
        assert lines[0].startswith("grid dp=2 pp=1 tp=2") and "node0 (" in lines[0], lines
        assert (len(lines) == 2) == spans, lines
        if spans:
            assert "tp group of world ranks" in lines[1] and "parallel.order" in lines[1], lines
        g.dp_comm.coll_mode = g.world_comm.coll_mode = "hier"
        # a dp pair on two nodes has one rank per node: nothing to do inside a node
        assert g.dp_comm.algorithm("allreduce", 1 << 20) != "hier"
        assert g.world_comm.algorithm("allreduce", 1 << 20) == "hier"
        g.free()

print(f"coll_hier OK rank {R}", flush=True)
