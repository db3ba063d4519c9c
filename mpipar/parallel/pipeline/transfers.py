"""The executor's messages: receives posted a window ahead, non-blocking sends released as they
finish. One ``Receives`` and one ``Sends`` per step (they hold that step's requests)."""

from __future__ import annotations

ACT, GRAD = 0, 1  # message kinds for tags
RECV_WINDOW = 2  # receives posted ahead per direction
SEND_BACKLOG = 4  # unfinished sends kept before testing which are done


def tag(kind, mb, chunk):
    from ...mpi.comm import make_tag

    return make_tag(kind, mb, chunk)


class Receives:
    """Posts a rank's RECV_F / RECV_B in the order it will need them, ``RECV_WINDOW`` ahead.

    ``source(op, chunk) -> (peer rank, boundary unit, tag kind)`` says where each comes from.
    Every received array lands in a fresh buffer (``irecv`` allocates), owned by its micro-batch.
    """

    def __init__(self, comm, actions, source, shape, dtype, xp):
        self.comm, self.source, self.shape, self.dtype, self.xp = comm, source, shape, dtype, xp
        self.plan = {"RECV_F": [], "RECV_B": []}
        for a in actions:
            if a.op in self.plan:
                self.plan[a.op].append(a)
        self.posted = {}
        self.next_post = {"RECV_F": 0, "RECV_B": 0}
        self.consumed = {"RECV_F": 0, "RECV_B": 0}
        for op in self.plan:
            self._post(op, RECV_WINDOW)

    def _post(self, op, upto):
        plan = self.plan[op]
        while self.next_post[op] < min(len(plan), upto):
            a = plan[self.next_post[op]]
            self.next_post[op] += 1
            peer, unit, kind = self.source(op, a.chunk)
            self.posted[(op, a.mb, a.chunk)] = self.comm.irecv(
                self.shape(unit), self.dtype, peer, tag(kind, a.mb, a.chunk),
                mb=a.mb, chunk=a.chunk, xp=self.xp)

    def take(self, a):
        """The array of receive action ``a`` (waits for it); posts the next one in line."""
        self.consumed[a.op] += 1
        self._post(a.op, self.consumed[a.op] + RECV_WINDOW)
        return self.posted.pop((a.op, a.mb, a.chunk)).wait()


class Sends:
    """Non-blocking sends of one step, released as they finish so their buffers can be freed."""

    def __init__(self):
        self.requests = []

    def add(self, req):
        self.requests.append(req)

    def release_finished(self):
        if len(self.requests) > SEND_BACKLOG:
            self.requests = [s for s in self.requests if not s.test()]

    def wait_all(self):
        for s in self.requests:
            s.wait()
