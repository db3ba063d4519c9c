"""Node-aware all-reduce and reduce-scatter for a communicator whose ranks span several nodes,
more than one of them on some node; and the job's topology (nodes, ranks per node, link rate).

A node is what MPI says shares memory (``Split_type(COMM_TYPE_SHARED)``). Where the ranks span
nodes, the shared window of ``shm.py`` cannot serve the whole group, but it still serves each
node's ranks:

- all-reduce on two nodes with m ranks each (the common case): every rank of a
  node owns a slice (1/m) of the message. Its node sum is reduced by that rank alone through the
  shared window (``shm.py``'s order: node rank 0 + 1 + ...), sent to the rank with the same node
  rank on the other node while its sum of the other's slice comes back, and a + b = b + a makes
  both the same bits; the sum goes into the window, and after one node barrier every rank
  copies the whole result out. Every rank of a node talks across the link at once, and the
  slice goes in pieces, so the node sum of piece k + 1 is computed while piece k crosses. Per
  node n bytes leave over the link, the least an all-reduce can send (MPICH's flat algorithm
  sends as much at 2 x 2 ranks, but in two phases with the node-local ones between them).
- all-reduce elsewhere (more nodes, or unequal ranks per node): the node's ranks all-reduce
  through their shared window; the node leaders (each node's lowest rank) all-reduce that node
  sum across nodes (the library's collective on two leaders, where a + b = b + a makes both
  results the same bits; Rabenseifner's, ``algorithms.py``, on more, each element reduced by
  one rank); each leader broadcasts the result to its node. Every rank ends with the leaders'
  bits, which are the bits of the two-node path above too (the same node sums, then a + b).
- reduce-scatter (p equal blocks, rank r keeps block r) on two nodes with m ranks each: rank r
  reduces over its node's inputs (through the window, node-rank order) its own block and its
  pair's; the pair's crosses at once while its own is reduced; it then adds the pair's sum of
  its own block that came back. Per node n / 2 bytes cross each way, from every rank at once.
- reduce-scatter elsewhere: the node sum as for the all-reduce; the leaders reduce-scatter it
  across nodes in node-sized pieces (each leader receives the blocks of its node's ranks,
  packed in node order), then scatter them to their node's ranks.

Each is a generator of steps (``algorithms.Stepper`` shape) whose first step is the shared
window's agreement barrier, so ``Shm.start`` / ``Shm.run`` of the node's ``Shm`` drive it like
one of its own collectives: one runs at a time per communicator (the node barriers, the leaders'
and the node's non-blocking collectives are posted in one order on every rank), a window too
small grows at the post, never inside a ``test()``.

Offered (``Hier.create``) only where the ranks span nodes and some node has two or more of them;
on one node ``shm.py`` runs, and with one rank per node there is nothing to do inside a node.

``MPIPAR_LINK_RATE`` (e.g. ``1gbit``; set by the launcher of an emulated or real cluster) is the
link rate recorded in the topology; "unknown" without it. One machine looks like several nodes
to MPICH when Hydra is given several host names for it: ``mpiexec -launcher fork -hosts
nodeA:2,nodeB:2 -n 4`` (the tests' way to run these paths without a cluster).
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from mpipar.mpi import algorithms as alg
from mpipar.mpi.shm import Shm
from mpipar.mpi.shm_registered import reduce_in_order
from mpipar.mpi.staging import from_host, is_device, load_mpi, to_host

ENV_LINK = "MPIPAR_LINK_RATE"
HIER_TAG = 31001  # the leaders' Rabenseifner, the pairs' pieces: one at a time per group
PIECE = 1 << 20  # bytes of one message to the pair: the unit the reduction and link overlap in
DEPTH = 4  # pieces on the link at once, beyond the one being reduced


def node_index(mpi_comm) -> list[int]:
    """Node of every rank of ``mpi_comm`` (0, 1, ... in order of each node's lowest rank), as
    MPI sees them (collective)."""
    MPI = load_mpi()
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        lowest = node.allreduce(mpi_comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    lows = np.zeros(mpi_comm.Get_size(), np.int64)
    mpi_comm.Allgather(np.array([lowest], np.int64), lows)
    order = {low: i for i, low in enumerate(sorted(set(lows.tolist())))}
    return [order[int(x)] for x in lows]


def topology(node_of, link=None) -> dict:
    """{"nodes", "ranks_per_node", "link"} of a job whose rank r is on node ``node_of[r]``."""
    counts = [0] * (max(node_of) + 1) if node_of else []
    for n in node_of:
        counts[n] += 1
    rate = link if link is not None else (os.environ.get(ENV_LINK, "").strip() or "unknown")
    return {"nodes": len(counts), "ranks_per_node": counts, "link": rate}


class Hier:
    """The node communicator, its shared window and the leaders' communicator of one group."""

    def __init__(self, comm, node, node_of):
        MPI = load_mpi()
        self.comm, self.node, self.node_of = comm, node, node_of
        self.rank = comm.Get_rank()
        self.nodes = max(node_of) + 1
        # the group ranks of every node, nodes in order of their lowest rank (= leaders' order)
        self.members = [[q for q, n in enumerate(node_of) if n == j] for j in range(self.nodes)]
        self.lead = node.Get_rank() == 0
        self.alone = node.Get_size() == 1  # a node with one rank of the group: nothing inside
        color = 0 if self.lead else MPI.UNDEFINED
        self.leaders = comm.Split(color, self.rank)  # COMM_NULL off the leaders
        # two nodes, m ranks each: the ranks of one node rank (a pair, one per node) exchange
        # their slices' node sums (``_pair_sum``); elsewhere the leaders' path
        sizes = {len(m) for m in self.members}
        self.paired = self.nodes == 2 and len(sizes) == 1
        here = self.node_of[self.rank]
        self.pairs = comm.Split(node.Get_rank() if self.paired else MPI.UNDEFINED, here)
        self.pair = 1 - here  # the other rank of the pair: ranked by node in ``pairs``
        self.shm = Shm(node)  # the node's ranks; also drives the whole collective's steps
        self.BYTE = MPI.BYTE

    @classmethod
    def create(cls, comm):
        """A Hier for ``comm`` (collective), or None where its ranks share one node or have one
        rank per node, or shared windows are refused (the same on every rank)."""
        MPI = load_mpi()
        node_of = node_index(comm)
        counts = np.bincount(node_of)
        if len(counts) < 2 or counts.max() < 2:
            return None
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            return cls(comm, node, node_of)
        except (NotImplementedError, MPI.Exception):
            node.Free()
            return None

    def free(self) -> None:
        MPI = load_mpi()
        self.shm.free()
        for c in (self.leaders, self.pairs):
            if c != MPI.COMM_NULL:
                c.Free()
        self.node.Free()

    # --- the collectives ------------------------------------------------------------------

    def allreduce(self, flat, mpi_op, op, what):
        """Steps of an in-place all-reduce of the 1-D array ``flat`` (module docstring)."""
        if is_device(flat):
            host = np.empty(flat.shape, flat.dtype)
            to_host(flat, host)
            yield from self._allreduce(host, mpi_op, op, what)
            from_host(host, flat)
        else:
            yield from self._allreduce(flat, mpi_op, op, what)

    def _allreduce(self, flat, mpi_op, op, what):
        if self.paired:
            yield from self.shm.allreduce(flat, op, what, across=self._pair_sum)
            return
        if not self.alone:
            yield from self.shm.allreduce(flat, op, what)  # the node's sum, on each of its ranks
        if self.lead:
            yield from self._leaders_allreduce(flat, mpi_op, op)
        if not self.alone:
            yield [self.node.Ibcast([flat, self.BYTE], 0)]

    def _leaders_allreduce(self, flat, mpi_op, op):
        if self.nodes == 2:  # two operands: the same bits on both leaders (commutative)
            yield [self.leaders.Iallreduce(load_mpi().IN_PLACE, flat, mpi_op)]
            return
        c = alg.Ctx(self.leaders, HIER_TAG, alg.reducer(op, False))
        yield from alg.rabenseifner_allreduce(c, flat, np.empty_like(flat))

    def _pair_sum(self, parts, dests, ufunc):
        """Steps: dests[0] = (this node's sum of ``parts``) op (the pair's), copied into every
        other dest (``shm.py``'s ``across``). Piece by piece: up to ``DEPTH`` pieces on the link
        while the next is reduced. dests[0] may be parts[0] (reduced into first; sent from
        before it takes the result)."""
        acc = dests[0]
        if acc.size == 0:
            return
        back = np.empty(acc.size, acc.dtype)  # the pair's node sum
        piece = max(1, PIECE // acc.itemsize)
        flying = deque()
        for lo in range(0, acc.size, piece):
            hi = min(acc.size, lo + piece)
            reduce_in_order(ufunc, [p[lo:hi] for p in parts], acc[lo:hi])
            flying.append((lo, hi, [self.pairs.Irecv(back[lo:hi], self.pair, HIER_TAG),
                                    self.pairs.Isend(acc[lo:hi], self.pair, HIER_TAG)]))
            while flying and (len(flying) > DEPTH or hi == acc.size):
                lo0, hi0, reqs = flying.popleft()
                yield reqs
                # a op b on one node, b op a on the other: the same bits (commutative)
                ufunc(acc[lo0:hi0], back[lo0:hi0], out=acc[lo0:hi0])
                for d in dests[1:]:
                    d[lo0:hi0] = acc[lo0:hi0]

    def _paired_reduce_scatter(self, x, out, op, what):
        """Two nodes, m ranks each: this rank's block is its node's sum plus the other node's
        sum of it, and the other node's sum of it is reduced by this rank's pair. So each rank
        reduces, over its node's inputs (in node-rank order, through the node's window), two
        blocks: its pair's, sent across at once, and its own, reduced while that crosses; then
        adds the pair's sum of its own block that came back. Per node n / 2 bytes cross each
        way, from every rank at once."""
        shm, p = self.shm, len(self.node_of)
        m, r, dt, k = shm.size, shm.rank, x.dtype, out.size
        ufunc = np.maximum if op == "max" else np.add
        mine, theirs = self.rank, self.members[self.pair][r]  # block numbers
        yield from shm._agree(what, "reduce_scatter", op, dt, x.nbytes)
        step = max(1, shm.window.capacity // (dt.itemsize * p))  # of each block, per round
        send, back = np.empty(min(k, step), dt), np.empty(min(k, step), dt)
        for lo in range(0, k, step):
            hi = min(k, lo + step)
            w = hi - lo
            if lo:
                yield from shm._sync()  # every rank has read its blocks of the last round
            segs = [shm.window.data(q, dt, p * w) for q in range(m)]
            for b in range(p):
                if b not in (mine, theirs):  # the blocks the node's other ranks reduce
                    segs[r][b * w:(b + 1) * w] = x[b * k + lo:b * k + hi]
            yield from shm._sync()

            def parts(b, segs=segs, lo=lo, hi=hi, w=w):
                got = [seg[b * w:(b + 1) * w] for seg in segs]
                got[r] = x[b * k + lo:b * k + hi]
                return got

            reduce_in_order(ufunc, parts(theirs), send[:w])
            reqs = [self.pairs.Irecv(back[:w], self.pair, HIER_TAG),
                    self.pairs.Isend(send[:w], self.pair, HIER_TAG)]
            reduce_in_order(ufunc, parts(mine), out[lo:hi])
            yield reqs
            ufunc(out[lo:hi], back[:w], out=out[lo:hi])  # this node's sum op the other's

    def reduce_scatter(self, x, out, mpi_op, op, what):
        """Steps of a reduce-scatter of the 1-D ``x`` (p equal blocks) into this rank's 1-D
        ``out`` (module docstring); x is not written."""
        if self.paired:
            host = out if not is_device(out) else np.empty(out.shape, out.dtype)
            xh = x
            if is_device(x) or np.may_share_memory(x, host):  # x is read until the end
                xh = np.empty(x.shape, x.dtype)
                if is_device(x):
                    to_host(x, xh)
                else:
                    np.copyto(xh, x)
            yield from self._paired_reduce_scatter(xh, host, op, what)
            if host is not out:
                from_host(host, out)
            return
        host = out if not is_device(out) else np.empty(out.shape, out.dtype)
        work = np.empty(x.shape, x.dtype)
        if is_device(x):
            to_host(x, work)
        else:
            work[...] = x
        if not self.alone:
            yield from self.shm.allreduce(work, op, what)  # the node's sum of every block
        k = host.size
        mine = len(self.members[self.node_of[self.rank]]) * k
        seg = np.empty(mine, x.dtype)
        if self.lead:
            order = [q for m in self.members for q in m]  # the blocks, packed node by node
            if order == list(range(len(order))):
                packed = work
            else:
                packed = np.concatenate([work[q * k:(q + 1) * k] for q in order])
            counts = [len(m) * k for m in self.members]
            yield [self.leaders.Ireduce_scatter(packed, seg, counts, mpi_op)]
        if self.alone:
            host[...] = seg
        else:
            yield [self.node.Iscatter(seg if self.lead else None, host, 0)]
        if host is not out:
            from_host(host, out)
