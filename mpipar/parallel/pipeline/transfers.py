"""The executor's messages: receives posted a window ahead into pooled buffers, non-blocking
sends released as they finish. One ``Receives`` and one ``Sends`` per step (they hold that step's
requests); the ``RecvPool`` of a communicator outlives steps."""

from __future__ import annotations

import sys
import weakref

from ...mpi import make_tag, progress
from .inflight import RECV_WINDOW, SEND_BACKLOG

ACT, GRAD = 0, 1  # message kinds for tags


tag = make_tag  # (kind, mb, chunk) -> tag; mpi.common imports no MPI, so no lazy import here


def receive_plan(actions) -> dict:
    """{"RECV_F": [(action, tag)...], "RECV_B": [...]}: a rank's receives in the order it takes
    them, each with its message's tag (the same every step, so an executor makes it once)."""
    plan = {"RECV_F": [], "RECV_B": []}
    for a in actions:
        if a.op in plan:
            plan[a.op].append((a, tag(ACT if a.op == "RECV_F" else GRAD, a.mb, a.chunk)))
    return plan


def _free_refs():
    bufs = [object()]
    return sys.getrefcount(bufs[0])  # as RecvPool.free_in counts: the list's, the call's two


_FREE_REFS = _free_refs()  # the count of a buffer only the pool's list holds


class RecvPool:
    """Receive buffers, reused once nothing but the pool references them.

    A received activation or gradient belongs to its micro-batch: layers keep their input (or
    views of it, which reference it) in the micro-batch's saved context until its backward, and
    the receive request holds it until ``wait``. A buffer is handed out again only when its
    reference count says the pool's list is its last holder, so a recycled buffer can never
    alias a live context; while any context still holds it, a new buffer is allocated. Reuse
    spares large messages the page faults of fresh memory on every receive.
    """

    def __init__(self):
        self._bufs = {}  # (shape, dtype, xp) -> [arrays]
        self.allocated = 0  # buffers ever allocated (tests check reuse)

    def take(self, shape, dtype, xp):
        return self.free_in(self.slot(shape, dtype, xp), shape, dtype, xp)

    def slot(self, shape, dtype, xp) -> list:
        """The buffers of one (shape, dtype, array module): a receive route looks it up once
        per step, not per message."""
        return self._bufs.setdefault((tuple(shape), dtype, xp), [])

    def free_in(self, bufs, shape, dtype, xp):
        """A buffer of ``bufs`` (a ``slot``) that nothing else holds, else a new one in it."""
        getrefcount = sys.getrefcount
        for i in range(len(bufs)):
            if getrefcount(bufs[i]) == _FREE_REFS:
                return bufs[i]
        buf = xp.empty(shape, dtype=dtype)
        bufs.append(buf)
        self.allocated += 1
        return buf

    def clear(self) -> None:
        self._bufs.clear()


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_for(comm) -> RecvPool:
    """The receive pool of ``comm`` (one per communicator, kept across steps)."""
    pool = _POOLS.get(comm)
    if pool is None:
        pool = _POOLS[comm] = RecvPool()
    return pool


class Receives:
    """Posts a rank's RECV_F / RECV_B in the order it will need them, ``RECV_WINDOW`` ahead.

    ``plan``: ``receive_plan(actions)``; ``routes[(op, chunk)] = (peer rank, shape, tag kind)``
    says where each receive comes from and what it holds (both the same every step, made once
    by the executor, not per message). Every received array lands in a buffer of the
    communicator's ``RecvPool``, owned by its micro-batch until the last reference to it goes.
    """

    def __init__(self, comm, plan, routes, dtype, xp, pool=None):
        self.comm, self.plan, self.dtype, self.xp = comm, plan, dtype, xp
        self.posted = {}
        self.next_post = {"RECV_F": 0, "RECV_B": 0}
        self.consumed = {"RECV_F": 0, "RECV_B": 0}
        # work for the step's first wait (the trainer's read of the next batch), or None: a
        # pipeline rank waits for its peers every step, a CPU rank with nothing else to do
        self.idle = None
        if not routes:  # nothing to receive (one stage): no pool, nothing to post
            self.pool, self.routes = pool, {}
            return
        self.pool = pool = pool if pool is not None else pool_for(comm)
        # (peer, shape, the pool's buffers of that shape) per route, looked up once per step
        self.routes = {key: (peer, shape, pool.slot(shape, dtype, xp))
                       for key, (peer, shape, _) in routes.items()}
        for op in self.plan:
            self._post(op, RECV_WINDOW)

    def _post(self, op, upto):
        plan, getrefcount = self.plan[op], sys.getrefcount
        while self.next_post[op] < min(len(plan), upto):
            a, wire_tag = plan[self.next_post[op]]
            self.next_post[op] += 1
            peer, shape, bufs = self.routes[(op, a.chunk)]
            for i in range(len(bufs)):  # RecvPool.free_in's scan, written out (one frame less)
                if getrefcount(bufs[i]) == _FREE_REFS:
                    out = bufs[i]
                    break
            else:  # none free: a new buffer in the slot
                out = self.pool.free_in(bufs, shape, self.dtype, self.xp)
            self.posted[(op, a.mb, a.chunk)] = self.comm.irecv(
                shape, self.dtype, peer, wire_tag, mb=a.mb, chunk=a.chunk, xp=self.xp, out=out)

    def take(self, a):
        """The array of receive action ``a`` (waits for it); posts the next one in line. The
        first time a message has not arrived yet, ``idle`` (if set) runs first, once."""
        op = a.op
        done = self.consumed[op] = self.consumed[op] + 1
        if self.next_post[op] < len(self.plan[op]):  # else nothing left to post this step
            self._post(op, done + RECV_WINDOW)
        req = self.posted.pop((op, a.mb, a.chunk))
        if self.idle is not None and not req.test():
            work, self.idle = self.idle, None
            work()
        return req.wait()


class Sends:
    """Non-blocking sends of one step, released as they finish so their buffers can be freed.
    Between actions it also advances the data-parallel collectives in flight (``progress``)."""

    def __init__(self):
        self.requests = []  # the executor appends each send's request

    def release_finished(self):
        progress()
        if len(self.requests) > SEND_BACKLOG:
            self.requests = [s for s in self.requests if not s.test()]

    def wait_all(self):
        for s in self.requests:
            s.wait()
