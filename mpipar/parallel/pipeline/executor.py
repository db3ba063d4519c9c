"""One executor for every schedule: runs a rank's action list on the chunks it holds.

Receives are posted ahead (a small window per direction) and sends are non-blocking, so transfers
overlap compute. Every received activation or gradient lands in a buffer owned by its micro-batch:
a layer's saved context keeps its input by reference, so the receive pool (``transfers.RecvPool``)
reuses a buffer only once nothing references it (reuse of a live one would corrupt the weight
gradients of an earlier micro-batch still in flight).

The loss is computed on the last chunk right after its forward (as Megatron does), scaled by
1 / microbatches so that the accumulated gradient is that of the mean over the whole batch.

Asynchronous PipeDream (``schedule.asynchronous``): each micro-batch is its own update. F runs
with its weight version and stashes it; BW runs with that stash (weight stashing, Harlap et al.
2018; ``stash.VersionStash``) on freshly zeroed gradients; UPDATE hands the gradient to
``on_update(mb, chunk)`` at once. The loss is not scaled by 1 / microbatches then. ``run`` drains
at its end (a step); a continuous schedule runs a step at a time through
``continuous.ContinuousRun``, draining only at the end of its lists.

Each rank's actions run in the order the schedule lists them: the schedule comes lowered
(``lowering.lower``), so what was checked, simulated and drawn is what runs.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from time import monotonic

from ... import progress
from ...mpi import MAX_MB, pending_collectives
from ...nn.layers import Sequential, set_selective_recompute
from ...trace import Clock
from .actions import Action, ScheduleError
from .stash import VersionStash
from .transfers import ACT, GRAD, SEND_BACKLOG, Receives, Sends, receive_plan, tag


class Chunk(Sequential):
    """A contiguous run of model units held by one rank: global chunk ``index``."""

    def __init__(self, index, units, first_unit):
        super().__init__(units, name=f"chunk{index}")
        self.index = index
        self.first_unit = first_unit
        self.last_unit = first_unit + len(units) - 1


class StepState:
    """Everything one ``run`` keeps between its actions."""

    def __init__(self, inputs, targets, forward_only, loss_scale, receives):
        self.inputs, self.targets = inputs, targets
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.acts_in, self.acts_out = {}, {}  # (mb, chunk) -> activation arriving at / leaving
        self.grads_in, self.grads_out = {}, {}  # (mb, chunk) -> gradient at output / input
        self.saved_inputs = {}  # recomputation: the chunk input of each micro-batch
        self.stash = None  # asynchronous only: stash.VersionStash
        self.losses = {}
        self.w_done = defaultdict(int)  # chunk -> weight-gradient passes done this step
        self.receives, self.sends = receives, Sends()

    def leftovers(self):
        return [k for k in (self.acts_in, self.acts_out, self.grads_in, self.grads_out,
                            self.receives.posted) if k]


class PipelineExecutor:
    """Runs ``schedule.ranks[pp_rank]`` each step, one small handler per action op.

    ``comm``: the pipeline communicator (a ``mpipar.mpi.comm.Comm``, or a ``LocalComm`` when
    pp = 1: a one-rank schedule has no sends or receives, so it is never used then).
    ``on_unit_ready(chunk_index, unit)``: called during a chunk's last weight-gradient pass,
    right after each unit's gradients become final, so data-parallel buckets can start reducing
    while the backward of the units before it goes on.
    ``on_grads_ready(chunk_index)``: called when a chunk's gradients are final for the step (its
    last backward-weight), so data-parallel buckets can start reducing while backward goes on.
    """

    def __init__(self, model, chunks: dict, schedule, pp_rank, *, comm, tracer=None,
                 recompute=False, backend=None, on_grads_ready=None, on_update=None,
                 on_unit_ready=None):
        self.model, self.chunks, self.schedule = model, chunks, schedule
        self.pp, self.pp_rank, self.comm = schedule.pp, pp_rank, comm
        self.n_chunks = schedule.n_chunks
        self.last = self.n_chunks - 1
        self.actions = schedule.ranks[pp_rank]
        # the receives in the order taken, as tagged, and their routes: made once, not per message
        self._plan, self._routes = receive_plan([_wire(a) for a in self.actions]), {}
        # recompute: False, True / "full" (whole chunks) or "selective" (attention cores only)
        self.tracer, self.backend = tracer, backend
        self.recompute = recompute is True or recompute == "full"
        if recompute == "selective":
            set_selective_recompute(chunks.values())
        self.on_grads_ready, self.on_update = on_grads_ready, on_update
        self.on_unit_ready = on_unit_ready
        self.asynchronous = schedule.asynchronous
        if self.asynchronous and on_update is None:
            raise ScheduleError("an asynchronous (PipeDream) schedule needs an on_update callback")
        for a in self.actions:
            if a.chunk not in chunks:
                raise ScheduleError(f"rank {pp_rank}: action {a} names chunk {a.chunk}, which "
                                    f"this rank does not hold (it holds {sorted(chunks)})")
        # each chunk's neighbours' ranks, looked up once rather than per message
        self._rank_of = {c: schedule.rank_of(c) for c in range(self.n_chunks)}
        self._handlers = {
            "F": self._forward, "B": self._backward, "BW": self._backward, "W": self._weight,
            "RECV_F": self._receive, "RECV_B": self._receive, "UPDATE": self._update,
        }
        # a send's peer and tag are fixed per action: bound with its handler, once
        self._bound = [(a, self._send_of(a) if a.op in ("SEND_F", "SEND_B")
                        else self._handlers[a.op]) for a in self.actions]
        timed = tracer is not None and tracer.enabled
        # one reused region for all compute actions (they never nest); None untimed: the
        # handlers then call the compute straight, with no context to enter and leave
        self._clock = Clock(tracer, schedule.microbatches) if timed else None

    # -- one step
    def run(self, inputs, targets, forward_only=False, idle=None):
        """inputs / targets: per micro-batch arrays. Returns {mb: loss} on the rank with the last
        chunk (empty elsewhere). ``forward_only``: evaluation, nothing kept for a backward.
        ``idle()``: work for this rank's first wait of the step, run once before the first
        receive whose message has not arrived (``Receives.idle``); not run if none is late."""
        m = self.schedule.microbatches
        if len(inputs) != m:
            raise ValueError(f"schedule has {m} micro-batches but {len(inputs)} were given")
        loss_scale = 1.0 if self.asynchronous else 1.0 / m
        if self.schedule.steps != 1:
            raise ScheduleError("a continuous schedule runs a step at a time: use "
                                "continuous.ContinuousRun")
        st = StepState(inputs, targets, forward_only, loss_scale, self._receives(inputs[0]))
        st.receives.idle = idle
        if self.asynchronous and not forward_only:
            st.stash = VersionStash(self.schedule, self.chunks)
        self.run_range(0, len(self._bound), st)
        self.finish(st)
        return st.losses

    def run_range(self, lo, hi, st):
        """Actions ``lo`` to ``hi`` (excluded) of this rank's list (``run``'s whole list; a
        continuous run's call, a stretch of one step's events at a time), each action's
        handler bound once, no look-up or call per action beyond it: a small model's action is
        a few hundred microseconds, and the Python between two actions runs with cold caches
        after a large one (BENCHMARKS.md, the fitted per-action overhead)."""
        sends, beat = st.sends, progress.state
        for a, handler in self._bound[lo:hi]:
            # progress.beat(a), written out: the watchdog names the action a stalled rank is
            # blocked in. After an action's NumPy work every distinct Python function the loop
            # enters costs a microsecond or two of cold caches (BENCHMARKS.md, "Eighth cuts"),
            # so the per-action path calls as few as it can.
            beat.last = monotonic()
            beat.what = a
            handler(a, st)
            # mpi.in_flight(), written out: non-blocking collectives outstanding
            if pending_collectives or len(sends.requests) > SEND_BACKLOG:  # else a no-op
                sends.release_finished()

    def finish(self, st):
        """The drain: every send done and nothing left over."""
        st.sends.wait_all()
        leftovers = st.leftovers()
        if leftovers:
            raise ScheduleError(f"rank {self.pp_rank}: schedule left data unused at the end of "
                                f"the step: {leftovers}")

    def _receives(self, x0):
        mb_batch = x0.shape[0]
        seq_len = x0.shape[1] if x0.ndim > 1 else None
        made = self._routes.get((mb_batch, seq_len))
        if made is None:  # once per micro-batch shape, not per message
            routes = {}
            for a, _ in self._plan["RECV_F"] + self._plan["RECV_B"]:
                peer, unit, kind = self._source(a.op, a.chunk)
                routes[(a.op, a.chunk)] = (
                    peer, self.model.boundary_shape(unit, mb_batch, seq_len), kind)
            # with the backend's dtype and array module (fixed for the run: two property reads
            # a step fewer); a rank with nothing to receive needs neither
            backend = self.backend
            made = self._routes[(mb_batch, seq_len)] = (
                routes, *((backend.dtype, backend.xp) if routes else (None, None)))
        return Receives(self.comm, self._plan, *made)

    def _source(self, op, c):
        """(sending rank, unit whose output it is, tag kind) of the receive ``op`` for chunk c."""
        if op == "RECV_F":
            return self.schedule.rank_of(c - 1), self.chunks[c].first_unit - 1, ACT
        return self.schedule.rank_of(c + 1), self.chunks[c].last_unit, GRAD

    # -- handlers, one per op
    def _forward(self, a, st):
        mb, c = a.mb, a.chunk
        chunk = self.chunks[c]
        # the data, or the activation received for it; _chunk_input for anything else
        if c == 0:
            x = st.inputs[mb]
        else:
            x = st.acts_in.pop((mb, c), None)
            if x is None:
                x = self._chunk_input(st, mb, c)
        clock = self._clock
        if st.stash is not None:
            if st.stash.copies(mb, c):  # the copy of a version is the stash's work, not F's
                self._stash_work(mb, c, st.stash.keep, mb, c, chunk)
            else:
                st.stash.keep(mb, c, chunk)
            with clock("F", mb, c) if clock else nullcontext(), st.stash.forward(mb, c, chunk):
                y = chunk.forward(x, mb)
        elif clock is None:
            y = chunk.forward(x, mb)
        else:
            y = clock.run("F", mb, c, chunk.forward, x, mb)
        if st.forward_only:
            self._forward_only_output(st, chunk, mb, c, y)
            return
        if self.recompute:
            st.saved_inputs[(mb, c)] = x
            chunk.drop(mb)  # keep only the input; rebuilt before the backward
        if c == self.last:
            if clock is None:
                self._loss(st, y, mb, c)
            else:
                clock.run("LOSS", mb, c, self._loss, st, y, mb, c)
        else:
            st.acts_out[(mb, c)] = y

    def _loss(self, st, y, mb, c):
        st.losses[mb] = self.model.loss.forward(y, st.targets[mb], mb, scale=st.loss_scale)
        st.grads_in[(mb, c)] = self.model.loss.backward(mb)

    def _forward_only_output(self, st, chunk, mb, c, y):
        """Evaluation: nothing kept for a backward; the last chunk only computes the loss."""
        chunk.drop(mb)
        if c == self.last:
            st.losses[mb] = self.model.loss.forward(y, st.targets[mb], mb, scale=st.loss_scale)
            self.model.loss.discard(mb)
        else:
            st.acts_out[(mb, c)] = y

    def _backward(self, a, st):
        """B (input gradient) or BW (input and weight gradients)."""
        mb, c = a.mb, a.chunk
        chunk = self.chunks[c]
        dy = st.grads_in.pop((mb, c), None)  # received, or the loss's
        if dy is None:  # the next chunk ran here (pp = 1), or the error
            dy = self._output_grad(st, mb, c)
        clock = self._clock
        if self.asynchronous:  # backward with the weights this micro-batch saw
            current = self._stash_work(mb, c, st.stash.swap_in, mb, c, chunk)
            try:
                dx = self._timed_backward(a.op, st, chunk, dy, mb)
            finally:
                st.stash.restore(chunk, current)
        elif self.recompute:
            dx = self._timed_backward(a.op, st, chunk, dy, mb)
        elif clock is None:  # _timed_backward without recomputation, written out
            dx = self._backward_pass(a.op, st, chunk, dy, mb)
        else:
            dx = clock.run("B", mb, c, self._backward_pass, a.op, st, chunk, dy, mb)
        if a.op == "BW":  # _weight_done, written out
            done = st.w_done[c] = st.w_done[c] + 1
            if done == self.schedule.microbatches and self.on_grads_ready is not None:
                self.on_grads_ready(c)
        if c > 0:
            st.grads_out[(mb, c)] = dx

    def _stash_work(self, mb, c, work, *args):
        """A weight-version action of an asynchronous run (the copy of a version before F or
        when an UPDATE ends it, the swap to a stashed version and gradient zeroing before BW),
        timed as STASH."""
        if self._clock is None:
            return work(*args)
        with self._clock("STASH", mb, c):
            return work(*args)

    def _timed_backward(self, op, st, chunk, dy, mb):
        """Recomputation (R) if any, then the backward (B), each its own region when traced."""
        clock = self._clock
        if self.recompute:
            with clock("R", mb, chunk.index) if clock else nullcontext():
                chunk.forward(st.saved_inputs.pop((mb, chunk.index)), mb)
        if clock is None:
            return self._backward_pass(op, st, chunk, dy, mb)
        with clock("B", mb, chunk.index):
            return self._backward_pass(op, st, chunk, dy, mb)

    def _backward_pass(self, op, st, chunk, dy, mb):
        if op == "BW":
            if self.on_unit_ready is not None and self._last_weight_pass(st, chunk.index):
                return self._backward_unit_by_unit(chunk, dy, mb)
            # layer by layer, both gradients while the layer's data is in cache (same bits)
            if chunk.index == 0:  # the model's input is data: its gradient is never used
                return chunk.backward_first(dy, mb)
            return chunk.backward(dy, mb)
        if chunk.index == 0:  # the model's input is data: its gradient is never used
            dx = chunk.backward_no_dx(dy, mb)
        else:
            dx = chunk.backward_input(dy, mb)
        return dx

    def _weight(self, a, st):
        mb, c = a.mb, a.chunk
        chunk = self.chunks[c]
        if self._clock is None:
            self._weight_pass(st, chunk, mb)
        else:
            self._clock.run("W", mb, c, self._weight_pass, st, chunk, mb)
        self._weight_done(st, c)

    def _weight_pass(self, st, chunk, mb):
        if self._last_weight_pass(st, chunk.index):
            for unit in reversed(chunk.layers):
                unit.backward_weight(mb)
                self.on_unit_ready(chunk.index, unit)
        else:
            chunk.backward_weight(mb)

    def _send_of(self, a):
        """SEND_F / SEND_B ``a``'s handler, its peer and tag bound (``_send``)."""
        forward = a.op == "SEND_F"
        to = a.chunk + 1 if forward else a.chunk - 1
        return partial(self._send, forward, self._rank_of[to],
                       tag(ACT if forward else GRAD, a.mb % MAX_MB, to))

    def _send(self, forward, peer, wire_tag, a, st):
        """Post the send of the activation (``forward``) or input gradient of ``a``."""
        mb, c = a.mb, a.chunk
        x = (st.acts_out if forward else st.grads_out).pop((mb, c))
        st.sends.requests.append(self.comm.isend(x, peer, wire_tag, mb=mb, chunk=c))

    def _receive(self, a, st):
        arr = st.receives.take(a if a.mb < MAX_MB else _wire(a))
        (st.acts_in if a.op == "RECV_F" else st.grads_in)[(a.mb, a.chunk)] = arr

    def _update(self, a, st):
        if self.on_update is None:
            raise ScheduleError("UPDATE actions need an asynchronous (PipeDream) run")
        self._stash_work(a.mb, a.chunk, st.stash.updating, a.chunk, self.chunks[a.chunk])
        self.on_update(a.mb, a.chunk)

    # -- where a compute's input comes from
    def _chunk_input(self, st, mb, c):
        if c == 0:
            return st.inputs[mb]
        if (mb, c) in st.acts_in:
            return st.acts_in.pop((mb, c))
        if self.schedule.rank_of(c - 1) == self.pp_rank and (mb, c - 1) in st.acts_out:
            return st.acts_out.pop((mb, c - 1))  # previous chunk ran here (pp = 1)
        raise ScheduleError(f"rank {self.pp_rank}: F{mb}.{c} has no input: a RECV_F{mb}.{c} "
                            f"must come before it")

    def _output_grad(self, st, mb, c):
        if (mb, c) in st.grads_in:
            return st.grads_in.pop((mb, c))
        if self.schedule.rank_of(c + 1) == self.pp_rank and (mb, c + 1) in st.grads_out:
            return st.grads_out.pop((mb, c + 1))
        raise ScheduleError(f"rank {self.pp_rank}: backward {mb}.{c} has no output "
                            f"gradient: a RECV_B{mb}.{c} must come before it")

    # -- unit-by-unit overlap of the last weight-gradient pass with data-parallel reduction
    def _last_weight_pass(self, st, c) -> bool:
        return (self.on_unit_ready is not None and not self.asynchronous
                and st.w_done[c] == self.schedule.microbatches - 1)

    def _backward_unit_by_unit(self, chunk, dy, mb):
        """The full backward of a chunk one unit at a time (the same arithmetic as
        backward_input then backward_weight), reporting each unit as its gradients are final."""
        layers = chunk.layers
        for i in range(len(layers) - 1, -1, -1):
            unit = layers[i]
            if i == 0 and chunk.index == 0:  # the model's input is data: no dx
                dy = unit.backward_no_dx(dy, mb)
            else:
                dy = unit.backward_input(dy, mb)
            unit.backward_weight(mb)
            self.on_unit_ready(chunk.index, unit)
        return dy

    def _weight_done(self, st, c):
        st.w_done[c] += 1
        if st.w_done[c] == self.schedule.microbatches and self.on_grads_ready is not None:
            self.on_grads_ready(c)


def build_chunks(model, bounds: dict, pp_rank: int, pp: int, rank_of=None) -> dict:
    """{global chunk: Chunk} for the chunks rank ``pp_rank`` holds, in model order. ``bounds``:
    chunk -> (lo, hi) unit ranges covering every unit exactly once; ``rank_of(chunk)``: the
    schedule's placement (default: the loop, chunk c on rank c % pp)."""
    out = {}
    for c, (lo, hi) in sorted(bounds.items()):
        if (rank_of(c) if rank_of is not None else c % pp) == pp_rank:
            out[c] = Chunk(c, model.units[lo:hi], lo)
    return out


def _wire(a):
    """A receive as its message is tagged: tags tell MAX_MB micro-batches apart, and a continuous
    schedule numbers more; receives are posted a short window ahead, so the wrap is harmless."""
    return Action(a.op, a.mb % MAX_MB, a.chunk) if a.mb >= MAX_MB else a
