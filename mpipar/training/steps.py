"""One class per training mode: how a step's gradients are taken and applied.

``Trainer`` picks one, once, from ``ResolvedRun.mode``; it keeps what all modes share (model
shard, chunks, gradient sync, optimizer, executor, batches) and each mode adds its own state:

- ``Synchronous``: a flush per step; gradients reduced as they become final, clipped by the
  global norm, one optimizer step (GPipe, 1F1B, interleaved, zero-bubble, V schedules...).
- ``TwoBW``: PipeDream-2BW with a flush per step: the gradients of step k are taken at the
  weights before step k-1's update (the older buffer) and applied to the current ones.
- ``PipeDream``: no flush inside a step's lists: each chunk steps on its own, once per
  micro-batch, from the executor's UPDATE actions (weight stashing; no global-norm clipping, a
  global norm needs every stage at one point).
- ``Continuous`` / ``ContinuousTwoBW``: pipedream / pipedream-2bw with no flush between steps
  either: the steps up to the next drain point form one continuous schedule
  (``ResolvedRun.segment``), run a step at a time; 2BW updates each chunk once per step (the
  gradient taken on the older buffer, which is kept per chunk and checkpointed).
"""

from __future__ import annotations

from ..nn.optim import clip_grads_
from ..parallel.pipeline.continuous import ContinuousRun
from ..parallel.pipeline.executor import PipelineExecutor
from ..progress import beat
from .lagged import LAG, LaggedReductions
from .optimizers import ChunkOptimizers, make_optimizer, step_lr


class OlderBuffer:
    """PipeDream-2BW's older weights, one array per parameter (in ``params`` order); made at
    the first step after any resume: W(-1) = W(0)."""

    def __init__(self, params):
        self.params, self.arrays = params, None

    def ensure(self):
        if self.arrays is None:
            self.arrays = [q.data.copy() for q in self.params]

    def named(self) -> dict:
        """{parameter name: older weights}, for checkpoints."""
        prev = self.arrays or [q.data for q in self.params]  # W(-1) = W(0) before step 0
        return {q.name: w for q, w in zip(self.params, prev)}

    def load(self, arrays: dict, xp):
        self.arrays = [xp.array(arrays[q.name], dtype=q.data.dtype) for q in self.params]

    def by_chunk(self, chunks: dict):
        """{chunk: arrays in chunk.params() order} (None: not made yet)."""
        if self.arrays is None:
            return None
        by_id = {id(q): w for q, w in zip(self.params, self.arrays)}
        return {c: [by_id[id(q)] for q in ch.params()] for c, ch in chunks.items()}


class Step:
    """One training mode (module doc). ``t``: the trainer whose shared state it uses."""

    metrics_lag = 0  # steps between a step and the reading of its loss (``settle``)

    def __init__(self, trainer):
        self.t = trainer
        self.older = None  # 2BW only: the OlderBuffer
        self._prefetched = None  # (step, its local batch) read ahead by ``_prefetch``
        self._grads_zero = False  # the last update left every gradient zero (``_zeroing``)
        self._zeroes_all = None

    def optimizer(self):
        t = self.t
        return make_optimizer(t.cfg, t.sync.optimizer_params(t.params))

    def callbacks(self) -> dict:
        """The executor's gradient callbacks: reduce each chunk once its gradients are final."""
        sync = self.t.sync
        return {"on_grads_ready": None if sync.idle else sync.chunk_ready, "on_update": None}

    @property
    def drained(self) -> bool:
        """No schedule in flight across steps (evaluation and stopping need it)."""
        return True

    def settle(self, rec: dict) -> list:
        """The step records complete now: this one (its loss was reduced in ``conclude``)."""
        return [rec]

    def _local_batch(self, step):
        held, self._prefetched = self._prefetched, None
        if held is not None and held[0] == step:
            return held[1]
        return self.t.local_batch("train", step)

    def _prefetch(self):
        """Read the next step's batch now: the executor's ``idle``, run while this rank waits
        for its first late message of the step, as a data loader reads ahead (PyTorch's
        ``prefetch_factor``). A small model's batch is several per cent of its step, and a
        pipeline rank waits every step. The rows are those of (seed, step) whenever read, so
        nothing changes but when; the batch is held until its step (dropped by any other)."""
        t = self.t
        nxt = t.step + 1
        if nxt < t.cfg.train.steps:
            with t.tracer.region("DATA"):
                self._prefetched = (nxt, t.local_batch("train", nxt))

    def _start(self):
        """This step's micro-batches, gradients zeroed, the dp buckets opened."""
        t = self.t
        xs, ys = self._local_batch(t.step)
        if not self._grads_zero:  # else the last update zeroed them while in cache
            t.sync.zero_grads(t.params)  # a fill per bucket, not a call per parameter
        self._grads_zero = False
        if not t.sync.idle:
            t.sync.start()
        return xs, ys

    def forward_backward(self, until=None) -> dict:
        """Gradients of this step's batch, fully synchronised (tp partial sums and dp)."""
        xs, ys = self._start()
        losses = self._run(xs, ys)
        sync = self.t.sync
        if not sync.idle:
            beat("the data-parallel gradient all-reduce")
            sync.finish()
        return losses

    def _run(self, xs, ys) -> dict:
        return self.t.executor.run(xs, ys, idle=self._prefetch)

    def update(self, losses=None) -> tuple[float, float]:
        """Clip by the global norm and step the optimizer. Returns (grad norm, lr). Given the
        step's ``losses``, their global mean comes with the norm (``t.step_loss``)."""
        t = self.t
        with t.tracer.region("OPT"):
            beat("the gradient-norm (and loss) all-reduce and the optimizer step")
            if losses is None:
                norm = t.grad_norm()
            else:
                norm, t.step_loss = t.norm_and_loss(losses)
            if t.cfg.train.grad_clip > 0:
                clip_grads_(t.sync.norm_params(t.params) if t.sync.zero1 else t.params,
                            t.cfg.train.grad_clip, norm)
            lr = step_lr(t.cfg, t.step)
            self._before_optimizer_step()
            zero = self._zeroing()
            t.opt.step(lr, zero_grad=zero)
            if not t.sync.idle:
                t.sync.after_step()
            self._grads_zero = zero
        return norm, lr

    def _zeroing(self) -> bool:
        """Whether the optimizer step zeroes the gradients, each block right after the update
        reads it (in cache), so that the next step need not zero them in a pass of its own
        (``_start``): where it updates every parameter itself. Not under ZeRO-1, whose
        optimizer holds slices of the buckets, nor where a gradient is a strided view (the
        optimizer's flat group of it may then be a copy, whose zeroing would not reach it); the
        gradients are then zeroed as the next step starts, as Megatron-LM zeroes its gradient
        buffers. Either way a step starts from zero gradients: ``forward_backward`` then
        ``update`` read the same values as ever; only ``.grad`` after an update reads zero
        here."""
        if self._zeroes_all is None:
            t = self.t
            self._zeroes_all = (not t.sync.zero1
                                and {id(p) for p in t.opt.params} == {id(p) for p in t.params}
                                and all(p.grad.flags.c_contiguous for p in t.params))
        return self._zeroes_all

    def _before_optimizer_step(self):
        pass

    def conclude(self, losses: dict) -> tuple[float, float, float]:
        """(loss, grad norm, lr) of the step whose ``losses`` forward_backward returned."""
        norm, lr = self.update(losses)
        return self.t.step_loss, norm, lr  # the loss came with the norm


class Synchronous(Step):
    """A flush per step (module doc)."""


class TwoBW(Step):
    """PipeDream-2BW, a flush per step (module doc): W(k+1) = W(k) - lr g_k(W(k-1))."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.older = OlderBuffer(trainer.params)

    def _run(self, xs, ys) -> dict:
        """The step on the older buffer; then the current weights come back."""
        params = self.t.params
        self.older.ensure()
        current = [p.data for p in params]
        for p, w in zip(params, self.older.arrays):
            p.data = w
        losses = super()._run(xs, ys)
        for p, w in zip(params, current):
            p.data = w
        return losses

    def _before_optimizer_step(self):
        for buf, p in zip(self.older.arrays, self.t.params):  # the current weights become
            buf[...] = p.data  # the older buffer


class PipeDream(Step):
    """An update per micro-batch, from UPDATE actions (module doc)."""

    def optimizer(self):
        t = self.t  # each chunk steps on its own
        return ChunkOptimizers({c: make_optimizer(t.cfg, ch.params())
                                for c, ch in t.chunks.items()})

    def callbacks(self) -> dict:
        return {"on_grads_ready": None, "on_update": self.apply_update}

    def forward_backward(self, until=None) -> dict:
        xs, ys = self._start()
        return self._run(xs, ys)  # the executor already applied every micro-batch's update

    def step_of(self, mb: int) -> int:
        """The training step of micro-batch ``mb`` of the running lists."""
        return self.t.step

    zero_after_update = False  # the optimizer zeroes the gradients it read (``Continuous``)

    def apply_update(self, mb, c):
        """Apply micro-batch mb's gradient to chunk c now (synchronised over tp, dp)."""
        t = self.t
        t.sync.reduce_now(c)
        with t.tracer.region("OPT", mb=mb % t.run.microbatches, chunk=c):
            t.opt.chunks[c].step(step_lr(t.cfg, self.step_of(mb)),
                                 zero_grad=self.zero_after_update)

    def update(self, losses=None):
        raise RuntimeError(f"a {self.t.run.mode} run updates from its UPDATE actions: there is "
                           f"no separate optimizer step")

    def conclude(self, losses: dict) -> tuple[float, float, float]:
        beat("the loss all-reduce")
        return self.t.global_loss(losses), float("nan"), step_lr(self.t.cfg, self.t.step)


class Continuous(PipeDream):
    """PipeDream with no flush between steps (module doc). The loss and the stop agreement
    are read ``lagged.LAG`` steps late, never in a per-step meeting (``lagged``)."""

    metrics_lag = LAG
    # each UPDATE zeroes the gradients as it reads them (in cache), and the stash skips the
    # zeroing before the chunk's next backward (``VersionStash.cleaned``): no pass of its own
    zero_after_update = True

    def __init__(self, trainer):
        super().__init__(trainer)
        self.segment = None  # the ContinuousRun in flight (None: drained)
        self.start_step = 0  # the step of micro-batch 0 of the running lists
        self._fed = {}
        self.lagged = LaggedReductions(trainer.grid.world_comm)
        self._due = []  # [(step, reduced values)] read by the last conclude

    def conclude(self, losses: dict) -> tuple[float, float, float]:
        """Posts this step's loss share and stop counts; reads those now due. The step's own
        loss comes with ``settle`` once read (NaN here)."""
        t = self.t
        stop = t.stop_signals.shares() if t.stop_signals is not None else []
        self.lagged.post(t.step, [t._loss_share(losses), *stop])
        self._due = self.lagged.ready(drain=self.drained)
        return float("nan"), float("nan"), step_lr(t.cfg, t.step)

    def settle(self, rec: dict) -> list:
        """The records whose lagged reduction was read in this step, oldest first, each with
        its loss and ``stop`` (the agreed stop signal, or 0)."""
        self.lagged.records[rec["step"]] = rec
        out = []
        signals = self.t.stop_signals
        for step, values in self._due:
            r = self.lagged.records.pop(step)
            r["loss"] = float(values[0])
            r["stop"] = signals.agree_from(values[1:]) if signals is not None else 0
            out.append(r)
        self._due = []
        return out

    @property
    def drained(self) -> bool:
        return self.segment is None

    def apply_update(self, mb, c):
        super().apply_update(mb, c)
        if self.segment is not None:  # (UPDATEs run inside a segment's calls)
            self.segment.st.stash.cleaned(c)

    def forward_backward(self, until=None) -> dict:
        """Step ``t.step`` of a continuous run, opening one (lists up to step ``until``, default
        the last) when none is in flight; the run drains after its last step."""
        if self.segment is None:
            self.segment = self._open(until)
        losses = self.segment.run_step()
        if self.segment.done:
            self.segment = None
        return losses

    def _open(self, until) -> ContinuousRun:
        t = self.t
        last = t.cfg.train.steps - 1
        n = max(1, min(last if until is None else until, last) - t.step + 1)
        ex = PipelineExecutor(
            t.model, t.chunks, t.run.segment(n), t.grid.pp_rank, comm=t.grid.pp_comm,
            tracer=t.tracer, recompute=t.cfg.parallel.recompute, backend=t.backend,
            on_update=self.apply_update)
        for q in t.params:
            q.zero_grad()
        older = self._older_by_chunk()
        self.start_step, self._fed = t.step, {}
        return ContinuousRun(ex, self._feed, older=older, zero=self._zero_chunk)

    def _zero_chunk(self, c) -> None:
        """Chunk c's gradients zeroed: one fill per bucket of ``GradSync``, which holds every
        parameter's gradient as a view (as ``GradSync.zero_grads`` relies on)."""
        for b in self.t.sync.buckets[c]:
            b.grad.fill(0)

    def _older_by_chunk(self):
        """The older weights the run starts with, {chunk: arrays} (None: PipeDream keeps
        none across runs)."""
        return None

    def _feed(self, k):
        """The local micro-batches of step k of the running lists (the trainer feeds step k+1
        while step k's are in flight); each batch is read once and dropped when done."""
        step = self.start_step + k
        if step not in self._fed:
            self._fed = {s: v for s, v in self._fed.items() if s >= self.t.step}
            self._fed[step] = self._local_batch(step)
        return self._fed[step]

    def step_of(self, mb: int) -> int:
        return self.start_step + mb // self.t.run.microbatches


class ContinuousTwoBW(Continuous):
    """PipeDream-2BW with no flush between steps (module doc): one update per chunk and step."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.older = OlderBuffer(trainer.params)
        self._slot_cache = {}

    def _older_by_chunk(self):
        self.older.ensure()
        return self.older.by_chunk(self.t.chunks)

    def apply_update(self, mb, c):
        """mb is its step's last; the step's gradient (taken on the older buffer) goes to the
        current weights, which first become the chunk's older buffer: the stash's copy of them
        when the next step's forwards kept one (never written to: a stashed version is only
        swapped in), else a copy."""
        stash = self.segment.st.stash if self.segment is not None else None
        ps = stash.params[c] if stash is not None else self.t.chunks[c].params()
        kept = stash.kept.get((c, stash.current[c] - 1)) if stash is not None else None
        arrays = self.older.arrays
        for i, w in zip(self._slots(c, ps), kept or [q.data.copy() for q in ps]):
            arrays[i] = w
        super().apply_update(mb, c)  # the gradients zeroed by the optimizer (``Continuous``)

    def _slots(self, c, ps) -> list:
        """Where chunk c's parameters ``ps`` sit in the trainer's list (found once)."""
        slots = self._slot_cache.get(c)
        if slots is None:
            at = {id(q): i for i, q in enumerate(self.t.params)}
            slots = self._slot_cache[c] = [at[id(q)] for q in ps]
        return slots


STEP_CLASSES = {"synchronous": Synchronous, "2bw": TwoBW, "pipedream": PipeDream,
                "continuous": Continuous, "continuous-2bw": ContinuousTwoBW}
