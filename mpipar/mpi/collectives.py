"""All-reduce, reduce-scatter and all-gather of a ``Comm``, each by the algorithm chosen for it.

A mixin: ``Comm`` (``comm.py``) supplies ``mpi``, ``axis``, ``size``, ``rank``, ``windows``
(``windows.py``: the duplicate communicator, the shared window, registered buffers),
``shm_offered``, ``_op``, ``_begin``, ``_stage`` and ``_rec``, and calls ``_coll_init``. The
algorithm is the forced one (``MPIPAR_COLLECTIVES``) or the table's choice for the kind, size and
group (``tuning.py``); the same on every rank, since all of them see the same arguments.
``library`` is MPI's own collective; ``ring`` and ``rabenseifner`` are ``algorithms.py``'s, run
on a duplicate communicator; ``shm`` is ``shm.py``'s shared window, offered only where every rank
shares one node; ``hier`` is ``hierarchical.py``'s node-aware pair (a shared window per node, the
node leaders across), offered only where the ranks span nodes with two or more on some node
(elsewhere each choice falls back as if it did not exist).
"""

from __future__ import annotations

from time import perf_counter as _now

import numpy as np

from mpipar.mpi import algorithms as alg
from mpipar.mpi.algorithms import KINDS
from mpipar.mpi.common import TAG_LIMIT, check_contiguous, check_divisible, check_float, norm_axis
from mpipar.mpi.staging import (
    POOL,
    copy_into,
    from_host,
    host_view,
    is_device,
    load_mpi,
    to_host,
    xp_of,
)
from mpipar.mpi.tuning import REGISTERED, TABLE_KINDS, choose, choose_placed

_ndarray = np.ndarray
_IN_PLACE = _SUM = None  # MPI.IN_PLACE and MPI.SUM, set by the first Comm


def _disjoint(a, b) -> bool:
    """a and b share no memory: both own theirs (the common case, no further test) or their
    address ranges do not overlap (MPI forbids aliased send and receive buffers)."""
    if a.base is None and b.base is None:
        return a is not b
    return not np.may_share_memory(a, b)


def _is_block(xm, out, r) -> bool:
    """Host xm is exactly block r of out (ZeRO-1's shard of its flat parameters), a block shm's
    all-gather leaves where it is."""
    if type(xm) is not _ndarray or type(out) is not _ndarray or not xm.ndim:
        return False
    block = out[r * xm.shape[0]:(r + 1) * xm.shape[0]]
    return block.shape == xm.shape and block.ctypes.data == xm.ctypes.data


class Collectives:
    """allreduce / reduce_scatter / allgather with a choice of algorithm."""

    _seq = 0  # collectives run so far: a fresh tag each, so overlapping ones never mix
    _regs = ()  # the registered windows (``Windows.regs``; ``Comm.registered_zeros``)

    def _coll_init(self, MPI) -> None:
        """Hoist what the fast paths need (called by ``Comm.__init__``)."""
        global _IN_PLACE, _SUM
        _IN_PLACE, _SUM = MPI.IN_PLACE, MPI.SUM
        self._k_ar, self._k_rs, self._k_ag = (f"{self.axis}.{k}" for k in KINDS)

    def _registered(self, x) -> bool:
        """x is (a contiguous view inside) one of this communicator's registered buffers."""
        return bool(self._regs) and self.windows.reg_shm.locate(x) is not None

    @property
    def coll_mode(self) -> str:
        """``MPIPAR_COLLECTIVES``'s forced algorithm or "auto" (commbench and tests set it)."""
        return self._coll_mode

    @coll_mode.setter
    def coll_mode(self, value) -> None:
        self._coll_mode = value
        # per mode and kind: bytes -> algorithm. The hot paths read these dicts directly, so a
        # repeated size costs one lookup (a group sees few distinct sizes; cleared if it sees
        # many); kept per mode, so commbench switching modes between calls keeps them warm
        self._algos = self._algos_by_mode.setdefault(value, {kind: {} for kind in TABLE_KINDS})
        self._ar_algo, self._rs_algo, self._ag_algo = (self._algos[k] for k in KINDS)

    def algorithm(self, kind, nbytes) -> str:
        """The algorithm a ``kind`` collective of ``nbytes`` (``tuning.choose``) runs with here."""
        cache = self._algos[kind]
        algo = cache.get(nbytes)
        if algo is None:
            if len(cache) > 4096:
                cache.clear()
            mode = self._coll_mode
            auto = (kind, nbytes, self.size, self.shm_offered, self.windows.hier_offered)
            algo = choose_placed(*auto) if mode == "auto" else mode
            if algo == "hier" and (kind == "allgather" or not self.windows.hier_offered()):
                algo = choose_placed(*auto)  # forced where it cannot run: auto's choice
            if algo == "shm" and not self.shm_offered():
                algo = choose(kind, nbytes, self.size, shm=False)
            cache[nbytes] = algo
        return algo

    def algorithm_for(self, kind, nbytes, x, registered=False) -> str:
        """``algorithm`` for the array ``x``: auto does not send device arrays through host shared
        memory (``shm`` copies them to the host and back, where MPI, CUDA-aware or staged, is the
        better path): for them it chooses as where shm is not offered. Forced, shm still runs.
        ``registered``: x is a registered buffer, worked on in place (its own rows)."""
        algo = self.algorithm(REGISTERED[kind] if registered else kind, nbytes)
        if algo in ("shm", "hier") and self._coll_mode == "auto" and is_device(x):
            return choose(kind, nbytes, self.size, shm=False, hier=False)
        return algo

    def _ctx(self, op, like):
        self._seq = self._seq % (TAG_LIMIT - 1) + 1
        return alg.Ctx(self.windows.dup(), self._seq, alg.reducer(op, is_device(like)))

    def _node_shm(self, algo):
        """The Shm that drives ``algo``'s steps (shm's own, the node's for hier), or None."""
        w = self.windows
        return w.shm if algo == "shm" else w.hier.shm if algo == "hier" else None

    def _drive(self, algo, steps) -> None:
        """Run an algorithm's steps to the end (blocking)."""
        shm = self._node_shm(algo)
        if shm is not None:
            shm.run(steps)
        else:
            alg.run(steps)

    def _post(self, algo, steps, need, registered=False):
        """An algorithm's steps in flight (non-blocking); ``need``: bytes per rank;
        ``registered``: shm's zero-copy path, queued behind the collectives in flight."""
        shm = self._node_shm(algo)
        if shm is not None:  # one at a time per group; a copying one grows the window here
            alone = algo == "hier" and self.windows.hier.alone  # first step: the leaders'
            return shm.start(steps, 0 if alone else need, queued=registered)
        return alg.Stepper(steps)

    def _work(self, n, dtype, like, host):
        """(a flat scratch array of n elements, release()) on the host or beside ``like``."""
        if host:
            buf = POOL.acquire(n * dtype.itemsize)
            return host_view(buf, (n,), dtype), lambda: POOL.release(buf)
        return xp_of(like).empty(n, dtype=dtype), lambda: None

    def _allreduce_steps(self, algo, flat, op):
        """The steps of an in-place all-reduce of ``flat`` by ``algo`` (not the library)."""
        if algo == "shm":
            return self.windows.shm.allreduce(flat, op, self._k_ar)
        if algo == "hier":
            return self.windows.hier.allreduce(flat, self._op(op), op, self._k_ar)
        return self._p2p_allreduce_steps(algo, flat, op)

    def _p2p_allreduce_steps(self, algo, flat, op):
        """The steps of an in-place all-reduce of ``flat``; scratch released at the end."""
        c = self._ctx(op, flat)
        host = not is_device(flat)
        n = flat.size
        if algo == "ring":
            tmp, release = self._work(-(-n // self.size), flat.dtype, flat, host)
            steps = alg.ring_allreduce(c, flat, tmp)
        else:
            tmp, release = self._work(n, flat.dtype, flat, host)
            steps = alg.rabenseifner_allreduce(c, flat, tmp)
        try:
            yield from steps
        finally:
            release()

    # --- all-reduce ------------------------------------------------------------------------

    def allreduce(self, x, op="sum", inplace=False):
        """Elementwise reduction over the group; a new array, or x itself when ``inplace``."""
        if op == "sum" and type(x) is _ndarray and self._fast and x.flags.c_contiguous:
            # the hot case, a sum of a host array by the library: its call plus one lookup
            n, kind, cache = x.nbytes, "allreduce", self._ar_algo
            if inplace and self._regs and self._registered(x):  # its own rows
                kind = REGISTERED[kind]
                cache = self._algos[kind]
            if (cache.get(n) or self.algorithm(kind, n)) == "library":
                tr = self.tracer
                start = _now() - tr.t0
                if inplace:
                    self.mpi.Allreduce(_IN_PLACE, x, _SUM)
                    out = x
                else:
                    out = np.empty(x.shape, x.dtype)
                    self.mpi.Allreduce(x, out, _SUM)
                tr.record_now(self._k_ar, start, -1, -1, n, -1)
                return out
        return self._allreduce_general(x, op, inplace)

    def _allreduce_general(self, x, op, inplace):
        mpi_op = self._op(op)
        if inplace:
            check_contiguous(x, f"{self.axis}.allreduce(inplace=True)")
        if op == "mean":
            check_float(x, "mean")
        start = self._begin(x)
        xp = xp_of(x)
        algo = self.algorithm_for("allreduce", x.nbytes, x, inplace and self._registered(x))
        MPI = load_mpi()
        if algo == "library" and not inplace and not self._stage(x):
            out = xp.empty(x.shape, dtype=x.dtype)
            self.mpi.Allreduce(xp.ascontiguousarray(x), out, mpi_op)
        else:
            out = x if inplace else xp.ascontiguousarray(x).copy()
            stage = self._stage(out) and algo != "shm"  # shm copies device memory itself
            buf = POOL.acquire(out.nbytes) if stage else None
            try:
                target = host_view(buf, out.shape, out.dtype) if stage else out
                if stage:
                    to_host(out, target)
                if algo == "library":
                    self.mpi.Allreduce(MPI.IN_PLACE, target, mpi_op)
                else:
                    self._drive(algo, self._allreduce_steps(algo, target.reshape(-1), op))
                if stage:
                    from_host(target, out)
            finally:
                if buf is not None:
                    POOL.release(buf)
        if op == "mean":
            out /= self.size
        self._rec("allreduce", start, nbytes=x.nbytes)
        return out

    # --- reduce-scatter and all-gather ----------------------------------------------------

    def reduce_scatter(self, x, axis=0, op="sum", out=None):
        """This rank's 1/size slice, along ``axis``, of the reduction of every rank's x; into
        ``out`` when given (axis 0 only, not overlapping x)."""
        if (axis == 0 and op == "sum" and type(x) is _ndarray and self._fast
                and x.flags.c_contiguous and x.ndim and x.shape[0] % self.size == 0):
            # the hot case: the library's call on x and out as they are
            n, kind, cache = x.nbytes, "reduce_scatter", self._rs_algo
            if self._regs and self._registered(x):  # a registered buffer: its own rows
                kind = REGISTERED[kind]
                cache = self._algos[kind]
            if (cache.get(n) or self.algorithm(kind, n)) == "library":
                shape = (x.shape[0] // self.size,) + x.shape[1:]
                if out is None:
                    out = np.empty(shape, x.dtype)
                elif not (type(out) is _ndarray and out.shape == shape and out.dtype == x.dtype
                          and out.flags.c_contiguous and _disjoint(x, out)):
                    return self._reduce_scatter_general(x, axis, op, out)
                tr = self.tracer
                start = _now() - tr.t0
                self.mpi.Reduce_scatter_block(x, out, _SUM)
                tr.record_now(self._k_rs, start, -1, -1, n, -1)
                return out
        return self._reduce_scatter_general(x, axis, op, out)

    def _reduce_scatter_general(self, x, axis, op, out):
        mpi_op = self._op(op)
        axis = norm_axis(axis, x.ndim)
        check_divisible(self.axis, self.size, x, axis)
        if op == "mean":
            check_float(x, "mean")
        xp = xp_of(x)
        if out is not None:
            self._check_out("reduce_scatter", x, out, axis,
                            (x.shape[0] // self.size,) + tuple(x.shape[1:]))
        start = self._begin(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        if out is None:
            out = xp.empty((x.shape[axis] // self.size,) + xm.shape[1:], dtype=x.dtype)
        algo = self.algorithm_for("reduce_scatter", x.nbytes, x, axis == 0 and self._registered(x))
        if algo == "library":
            self._in_out(lambda s, r: self.mpi.Reduce_scatter_block(s, r, mpi_op), xm, out)
        else:
            self._drive(algo, self._reduce_scatter_steps(algo, xm, out, op))
        if op == "mean":
            out /= self.size
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("reduce_scatter", start, nbytes=x.nbytes)
        return out

    def _reduce_scatter_steps(self, algo, xm, out, op):
        """The steps of a reduce-scatter of contiguous xm (p blocks along axis 0) into
        contiguous out, by ``algo`` (not the library)."""
        if algo == "shm":
            if xp_of(xm).may_share_memory(xm, out) and not self._registered(xm):
                xm = xm.copy()  # out is written before the last chunk of xm is read
            return self.windows.shm.reduce_scatter(xm.reshape(-1), out.reshape(-1), op, self._k_rs)
        if algo == "hier":
            return self.windows.hier.reduce_scatter(xm.reshape(-1), out.reshape(-1),
                                                    self._op(op), op, self._k_rs)
        return self._p2p_reduce_scatter_steps(algo, xm, out, op)

    def _p2p_reduce_scatter_steps(self, algo, xm, out, op):
        """Ring or Rabenseifner; the input is copied first, so xm is free once the first step
        is posted."""
        host = self._stage(xm) or not is_device(xm)
        n, p, r = xm.size, self.size, self.rank
        k = n // p
        work, release_w = self._work(n + k, xm.dtype, xm, host)  # the input's copy, then ours
        tmp, release_t = self._work(n if algo == "rabenseifner" else k, xm.dtype, xm, host)
        try:
            data, mine = work[:n], work[n:]
            copy_into(xm.reshape(-1), data)
            c = self._ctx(op, work)
            if algo == "ring":
                yield from alg.ring_reduce_scatter(c, data, tmp, alg.bounds(n, p))
                mine = data[r * k:(r + 1) * k]
            else:
                yield from alg.rabenseifner_reduce_scatter(c, data, tmp, mine)
            copy_into(mine.reshape(out.shape), out)
        finally:
            release_w()
            release_t()

    def allgather(self, x, axis=0, out=None):
        """Concatenation of every rank's x (all the same shape) along ``axis``, in rank order;
        into ``out`` when given (axis 0 only: a reused buffer spares fresh-memory page faults)."""
        if axis == 0 and type(x) is _ndarray and self._fast and x.flags.c_contiguous and x.ndim:
            # the hot case: the library's call on x and out as they are
            n = x.nbytes * self.size
            if (self._ag_algo.get(n) or self.algorithm("allgather", n)) == "library":
                shape = (x.shape[0] * self.size,) + x.shape[1:]
                if out is None:
                    out = np.empty(shape, x.dtype)
                elif not (type(out) is _ndarray and out.shape == shape and out.dtype == x.dtype
                          and out.flags.c_contiguous and _disjoint(x, out)):
                    return self._allgather_general(x, axis, out)
                tr = self.tracer
                start = _now() - tr.t0
                self.mpi.Allgather(x, out)
                tr.record_now(self._k_ag, start, -1, -1, x.nbytes, -1)
                return out
        return self._allgather_general(x, axis, out)

    def _allgather_general(self, x, axis, out):
        axis = norm_axis(axis, x.ndim)
        xp = xp_of(x)
        if out is not None:
            self._check_out("allgather", x, out, axis,
                            (self.size * x.shape[0],) + tuple(x.shape[1:]))
        start = self._begin(x)
        xm = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
        algo = self.algorithm_for("allgather", x.nbytes * self.size, x)
        if out is None:
            out = xp.empty((self.size * xm.shape[0],) + xm.shape[1:], dtype=x.dtype)
        elif xp.may_share_memory(xm, out) and not (algo == "shm" and _is_block(xm, out, self.rank)):
            xm = xm.copy()  # e.g. ZeRO-1's slice is a view of out; MPI forbids aliased buffers
        if algo == "library":
            self._in_out(self.mpi.Allgather, xm, out)
        else:
            self._allgather_alg(algo, xm, out)
        if axis != 0:
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, axis))
        self._rec("allgather", start, nbytes=x.nbytes)
        return out

    def _allgather_alg(self, algo, xm, out):
        if algo == "shm":
            shm = self.windows.shm
            shm.run(shm.allgather(xm.reshape(-1), out.reshape(-1), self._k_ag))
            return
        stage = self._stage(xm)
        k, r = xm.size, self.rank
        buf = POOL.acquire(out.nbytes) if stage else None
        try:
            flat = host_view(buf, (out.size,), out.dtype) if stage else out.reshape(-1)
            copy_into(xm.reshape(-1), flat[r * k:(r + 1) * k])
            c = self._ctx("sum", flat)
            if algo == "ring":
                alg.run(alg.ring_allgather(c, flat, alg.bounds(flat.size, self.size)))
            else:
                alg.run(alg.rabenseifner_allgather(c, flat))
            if stage:
                from_host(flat.reshape(out.shape), out)
        finally:
            if buf is not None:
                POOL.release(buf)

    def _check_out(self, op, x, out, axis, want) -> None:
        if axis != 0 or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"{self.axis}.{op}(out=...): out is {tuple(out.shape)} {out.dtype}, "
                             f"expected {want} {x.dtype} (and axis 0)")
        check_contiguous(out, f"{self.axis}.{op}(out=...)")

    def _in_out(self, call, xin, out) -> None:
        """call(send, recv) on xin and out directly, or on host copies when staging."""
        if not self._stage(xin):
            call(xin, out)
            return
        bin_, bout = POOL.acquire(xin.nbytes), POOL.acquire(out.nbytes)
        try:
            hin = host_view(bin_, xin.shape, xin.dtype)
            hout = host_view(bout, out.shape, out.dtype)
            to_host(xin, hin)
            call(hin, hout)
            from_host(hout, out)
        finally:
            POOL.release(bin_)
            POOL.release(bout)
