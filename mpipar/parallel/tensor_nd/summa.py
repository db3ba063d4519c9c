"""SUMMA on a q x q grid (van de Geijn & Watts 1997; Optimus's three products): C = A B,
C = A B^T and C = A^T B, each block (i, j) on rank (i, j).

Every product takes q steps; step k broadcasts one block along a row or a column and multiplies
locally. Where the result of step k belongs to one rank of a row (column), the q partial blocks
are stacked and reduce-scattered in one call: the same bytes as q reductions to one root each
(a reduce-scatter of q blocks moves what q reduces of one block move), with one message latency.
Operands are 2-D (tokens, features) views; the caller reshapes.
"""

from __future__ import annotations

from ...backend import array_module


def _bcast(comm, x, root):
    """Root's block on every rank of comm (root's own array is passed, not copied)."""
    xp = array_module(x)
    buf = xp.ascontiguousarray(x) if comm.rank == root else xp.empty(x.shape, dtype=x.dtype)
    return comm.broadcast(buf, root=root)


def ab(a, b, tp):
    """C_ij = sum_k A_ik B_kj: A's blocks travel along rows, B's along columns."""
    out = None
    for k in range(tp.q):
        ak = _bcast(tp.row, a, k)
        bk = _bcast(tp.col, b, k)
        prod = ak @ bk
        if out is None:
            out = prod
        else:
            out += prod
    return out


def abt(a, b, tp):
    """C_il = sum_j A_ij B_lj^T: B's block l travels along column j, the partial products are
    reduced along row i onto (i, l)."""
    xp = array_module(a)
    parts = xp.empty((tp.q, a.shape[0], b.shape[0]), dtype=a.dtype)
    for k in range(tp.q):
        bk = _bcast(tp.col, b, k)
        xp.matmul(a, bk.T, out=parts[k])
    return tp.row.reduce_scatter(parts, axis=0)[0]


def atb(a, b, tp):
    """C_kj = sum_i A_ik^T B_ij: A's block k travels along row i, the partial products are
    reduced along column j onto (k, j)."""
    xp = array_module(a)
    parts = xp.empty((tp.q, a.shape[1], b.shape[1]), dtype=a.dtype)
    for k in range(tp.q):
        ak = _bcast(tp.row, a, k)
        xp.matmul(ak.T, b, out=parts[k])
    return tp.col.reduce_scatter(parts, axis=0)[0]
