"""One executor for every schedule: runs a rank's action list on the chunks it holds.

Receives are posted ahead (a small window per direction) and sends are non-blocking, so transfers
overlap compute. Every received activation or gradient lands in a fresh buffer owned by its
micro-batch: a layer's saved context keeps its input by reference, and reusing a receive buffer
would silently corrupt the weight gradients of an earlier micro-batch still in flight.

The loss is computed on the last chunk right after its forward (as Megatron does), scaled by
1 / microbatches so that the accumulated gradient is that of the mean over the whole batch.

Asynchronous PipeDream (``schedule.asynchronous``): each micro-batch is its own update. F stashes
the weights it ran with; BW runs with that stash (weight stashing, Harlap et al. 2018) on freshly
zeroed gradients; UPDATE hands the gradient to ``on_update(mb, chunk)`` at once. The loss is not
scaled by 1 / microbatches then. The pipeline still drains at the end of each ``run`` (a step).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

from ...nn.layers import Sequential
from .actions import ScheduleError

ACT, GRAD = 0, 1  # message kinds for tags
RECV_WINDOW = 2  # receives posted ahead per direction


class Chunk(Sequential):
    """A contiguous run of model units held by one rank: global chunk ``index``."""

    def __init__(self, index, units, first_unit):
        super().__init__(units, name=f"chunk{index}")
        self.index = index
        self.first_unit = first_unit
        self.last_unit = first_unit + len(units) - 1


class PipelineExecutor:
    """Runs ``schedule.ranks[pp_rank]`` each step.

    ``comm``: the pipeline communicator (``mpipar.mpi.comm.Comm``; None when pp = 1).
    ``on_unit_ready(chunk_index, unit)``: called during a chunk's last weight-gradient pass,
    right after each unit's gradients become final, so data-parallel buckets can start reducing
    while the backward of the units before it goes on.
    ``on_grads_ready(chunk_index)``: called when a chunk's gradients are final for the step (its
    last backward-weight), so data-parallel buckets can start reducing while backward goes on.
    """

    def __init__(self, model, chunks: dict, schedule, pp_rank, *, comm=None, tracer=None,
                 recompute=False, backend=None, on_grads_ready=None, on_update=None,
                 on_unit_ready=None):
        self.model, self.chunks, self.schedule = model, chunks, schedule
        self.pp, self.pp_rank, self.comm = schedule.pp, pp_rank, comm
        self.n_chunks = schedule.pp * schedule.virtual
        self.actions = schedule.ranks[pp_rank]
        self.tracer, self.recompute, self.backend = tracer, recompute, backend
        self.on_grads_ready, self.on_update = on_grads_ready, on_update
        self.on_unit_ready = on_unit_ready
        self.asynchronous = bool(getattr(schedule, "asynchronous", False))
        if self.asynchronous and on_update is None:
            raise ScheduleError("an asynchronous (PipeDream) schedule needs an on_update callback")
        for a in self.actions:
            if a.chunk not in chunks:
                raise ScheduleError(f"rank {pp_rank}: action {a} names chunk {a.chunk}, which "
                                    f"this rank does not hold (it holds {sorted(chunks)})")

    # -- helpers
    def _region(self, kind, mb, chunk):
        if self.tracer is None:
            return nullcontext()
        return self.tracer.region(kind, mb=mb, chunk=chunk)

    def _rank_of(self, chunk):
        return chunk % self.pp

    def _shape(self, unit, mb_batch, seq_len):
        return self.model.boundary_shape(unit, mb_batch, seq_len)

    @staticmethod
    def _tag(kind, mb, chunk):
        from ...mpi.comm import make_tag

        return make_tag(kind, mb, chunk)

    # -- one step
    def run(self, inputs, targets, forward_only=False):
        """inputs / targets: per micro-batch arrays. Returns {mb: loss} on the rank with the last
        chunk (empty elsewhere). ``forward_only``: evaluation, nothing kept for a backward."""
        m = self.schedule.microbatches
        if len(inputs) != m:
            raise ValueError(f"schedule has {m} micro-batches but {len(inputs)} were given")
        mb_batch = inputs[0].shape[0]
        seq_len = inputs[0].shape[1] if inputs[0].ndim > 1 else None
        dtype = self.backend.dtype
        xp = self.backend.xp
        last = self.n_chunks - 1
        acts_in, acts_out = {}, {}  # (mb, chunk) -> activation arriving at / leaving a chunk
        grads_in, grads_out = {}, {}  # (mb, chunk) -> gradient at a chunk's output / input
        saved_inputs = {}  # recomputation: the chunk input of each micro-batch
        losses = {}
        stash = {}  # asynchronous: (mb, chunk) -> the weights F ran with
        loss_scale = 1.0 if self.asynchronous else 1.0 / m
        sends = []
        w_done = defaultdict(int)

        # receives in the order this rank will need them, posted a window ahead
        recv_plan = {"RECV_F": [], "RECV_B": []}
        for a in self.actions:
            if a.op in recv_plan:
                recv_plan[a.op].append(a)
        posted, next_post = {}, {"RECV_F": 0, "RECV_B": 0}

        def post(op, upto):
            plan = recv_plan[op]
            while next_post[op] < min(len(plan), upto):
                a = plan[next_post[op]]
                next_post[op] += 1
                c = a.chunk
                if op == "RECV_F":
                    shape = self._shape(self.chunks[c].first_unit - 1, mb_batch, seq_len)
                    req = self.comm.irecv(shape, dtype, self._rank_of(c - 1),
                                          self._tag(ACT, a.mb, c), mb=a.mb, chunk=c, xp=xp)
                else:
                    shape = self._shape(self.chunks[c].last_unit, mb_batch, seq_len)
                    req = self.comm.irecv(shape, dtype, self._rank_of(c + 1),
                                          self._tag(GRAD, a.mb, c), mb=a.mb, chunk=c, xp=xp)
                posted[(op, a.mb, c)] = req

        consumed = {"RECV_F": 0, "RECV_B": 0}
        if self.comm is not None:
            for op in recv_plan:
                post(op, RECV_WINDOW)

        def chunk_input(mb, c):
            if c == 0:
                return inputs[mb]
            if (mb, c) in acts_in:
                return acts_in.pop((mb, c))
            if self._rank_of(c - 1) == self.pp_rank and (mb, c - 1) in acts_out:
                return acts_out.pop((mb, c - 1))  # previous chunk ran here (pp = 1)
            raise ScheduleError(f"rank {self.pp_rank}: F{mb}.{c} has no input: a RECV_F{mb}.{c} "
                                f"must come before it")

        def output_grad(mb, c):
            if (mb, c) in grads_in:
                return grads_in.pop((mb, c))
            if self._rank_of(c + 1) == self.pp_rank and (mb, c + 1) in grads_out:
                return grads_out.pop((mb, c + 1))
            raise ScheduleError(f"rank {self.pp_rank}: backward {mb}.{c} has no output "
                                f"gradient: a RECV_B{mb}.{c} must come before it")

        for a in self.actions:
            mb, c, op = a.mb, a.chunk, a.op
            chunk = self.chunks[c]
            if op == "F":
                x = chunk_input(mb, c)
                with self._region("F", mb, c):
                    y = chunk.forward(x, mb)
                if forward_only:
                    chunk.drop(mb)
                    if c == last:
                        losses[mb] = self.model.loss.forward(y, targets[mb], mb, scale=loss_scale)
                        self.model.loss._ctx.pop(mb, None)
                    else:
                        acts_out[(mb, c)] = y
                    continue
                if self.asynchronous:
                    stash[(mb, c)] = [p.data.copy() for p in chunk.params()]
                if self.recompute:
                    saved_inputs[(mb, c)] = x
                    chunk.drop(mb)  # keep only the input; rebuilt before the backward
                if c == last:
                    with self._region("LOSS", mb, c):
                        losses[mb] = self.model.loss.forward(y, targets[mb], mb, scale=loss_scale)
                        grads_in[(mb, c)] = self.model.loss.backward(mb)
                else:
                    acts_out[(mb, c)] = y
            elif op in ("B", "BW"):
                dy = output_grad(mb, c)
                current = None
                if self.asynchronous:  # backward with the weights this micro-batch saw
                    params = chunk.params()
                    current = [p.data for p in params]
                    for p, w in zip(params, stash.pop((mb, c))):
                        p.data = w
                        p.zero_grad()
                if self.recompute:
                    with self._region("R", mb, c):
                        chunk.forward(saved_inputs.pop((mb, c)), mb)
                with self._region(op if op == "B" else "B", mb, c):
                    if op == "BW" and self._last_weight_pass(w_done, c, m):
                        dx = self._backward_unit_by_unit(chunk, dy, mb)
                    else:
                        dx = chunk.backward_input(dy, mb)
                        if op == "BW":
                            chunk.backward_weight(mb)
                if current is not None:
                    for p, w in zip(params, current):
                        p.data = w
                if op == "BW":
                    self._weight_done(w_done, c, m)
                if c > 0:
                    grads_out[(mb, c)] = dx
            elif op == "W":
                with self._region("W", mb, c):
                    if self._last_weight_pass(w_done, c, m):
                        for unit in reversed(chunk.layers):
                            unit.backward_weight(mb)
                            self.on_unit_ready(c, unit)
                    else:
                        chunk.backward_weight(mb)
                self._weight_done(w_done, c, m)
            elif op == "SEND_F":
                y = acts_out.pop((mb, c))
                sends.append(self.comm.isend(y, self._rank_of(c + 1), self._tag(ACT, mb, c + 1),
                                             mb=mb, chunk=c))
            elif op == "SEND_B":
                dx = grads_out.pop((mb, c))
                sends.append(self.comm.isend(dx, self._rank_of(c - 1), self._tag(GRAD, mb, c - 1),
                                             mb=mb, chunk=c))
            elif op in ("RECV_F", "RECV_B"):
                consumed[op] += 1
                post(op, consumed[op] + RECV_WINDOW)
                arr = posted.pop((op, mb, c)).wait()
                (acts_in if op == "RECV_F" else grads_in)[(mb, c)] = arr
            elif op == "UPDATE":
                if self.on_update is None:
                    raise ScheduleError("UPDATE actions need an asynchronous (PipeDream) run")
                self.on_update(mb, c)
            # release finished sends as we go, so their buffers can be freed
            if len(sends) > 4:
                sends = [s for s in sends if not s.test()]
        for s in sends:
            s.wait()
        leftovers = [k for k in (acts_in, acts_out, grads_in, grads_out, posted) if k]
        if leftovers:
            raise ScheduleError(f"rank {self.pp_rank}: schedule left data unused at the end of "
                                f"the step: {leftovers}")
        return losses

    def _last_weight_pass(self, w_done, c, m) -> bool:
        return (self.on_unit_ready is not None and not self.asynchronous
                and w_done[c] == m - 1)

    def _backward_unit_by_unit(self, chunk, dy, mb):
        """The full backward of a chunk one unit at a time (the same arithmetic as
        backward_input then backward_weight), reporting each unit as its gradients are final."""
        for unit in reversed(chunk.layers):
            dy = unit.backward_input(dy, mb)
            unit.backward_weight(mb)
            self.on_unit_ready(chunk.index, unit)
        return dy

    def _weight_done(self, w_done, c, m):
        w_done[c] += 1
        if w_done[c] == m and self.on_grads_ready is not None:
            self.on_grads_ready(c)


def forward_only_schedule(pp: int, microbatches: int, virtual: int = 1):
    """Evaluation: every micro-batch through every chunk in order, no backward.

    Each rank walks (micro-batch, chunk) in lexicographic order and every F depends only on a
    lexicographically earlier F, so the earliest unfinished action can always run: no deadlock.
    """
    from .actions import Action, Schedule

    n = pp * virtual
    ranks = [[] for _ in range(pp)]
    for mb in range(microbatches):
        for c in range(n):
            r = ranks[c % pp]
            if c > 0:
                r.append(Action("RECV_F", mb, c))
            r.append(Action("F", mb, c))
            if c < n - 1:
                r.append(Action("SEND_F", mb, c))
    return Schedule(kind="forward", pp=pp, virtual=virtual, microbatches=microbatches,
                    ranks=ranks)


def build_chunks(model, bounds: dict, pp_rank: int, pp: int) -> dict:
    """{global chunk: Chunk} for the chunks rank ``pp_rank`` holds. ``bounds``: chunk -> (lo, hi)
    unit ranges covering every unit exactly once."""
    out = {}
    for c, (lo, hi) in sorted(bounds.items()):
        if c % pp == pp_rank:
            out[c] = Chunk(c, model.units[lo:hi], lo)
    return out
