"""One training step on this rank: forward / backward through the pipeline executor, gradient
synchronisation (tp partial sums, dp buckets), clipping by the global norm, the optimizer step.

The executor reports gradients straight to ``GradSync`` (its ``unit_ready`` / ``chunk_ready``);
the trainer wires them up and steps. Asynchronous PipeDream updates each chunk once per
micro-batch instead, from the executor's UPDATE actions.

``parallel.continuous`` (pipedream, pipedream-2bw): no flush between steps. The steps from now
to the next drain point (``train_step(until=...)``: the loop passes the next evaluation,
checkpoint or the end) form one continuous schedule (``generators.continuous``), run a step at a
time; each call feeds the batches of the steps whose forwards start early. 2BW then updates each
chunk once per step from its UPDATE action (the gradient taken on the older buffer, which the
trainer keeps per chunk and checkpoints); no global-norm clipping there (a global norm needs
every stage at one point, i.e. a flush), as for PipeDream.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..backend import Backend
from ..config import Config
from ..models import build_model, stage_bounds
from ..nn.optim import SGD, AdamW, clip_grads_, grad_norm_sq_local, lr_at
from ..parallel.data import GradSync
from ..parallel.pipeline.executor import PipelineExecutor, build_chunks, forward_only_schedule
from ..parallel.tensor_nd import tp_context
from ..progress import beat
from ..trace import Tracer
from .batches import Batches, local_microbatches
from .memory import record_setup, step_peak


def step_lr(cfg: Config, step: int) -> float:
    """The learning rate of 0-based step ``step`` of the run ``cfg`` describes."""
    t = cfg.train
    # a short run (--steps 3 on a config made for 200) keeps a warm-up that fits it
    return lr_at(step, t.lr, min(t.warmup_steps, t.steps - 1), t.steps, t.min_lr)


def chunk_bounds(cfg: Config, model, schedule) -> dict:
    """{chunk: (first unit, end unit)} of the pipeline cut (``models.stage_bounds``)."""
    return stage_bounds(cfg.model, cfg.parallel, schedule.pp, schedule.virtual_stages)


def make_optimizer(cfg: Config, params):
    t = cfg.train
    if t.optimizer == "adamw":
        return AdamW(params, t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                     weight_decay=t.weight_decay)
    return SGD(params, t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


class ChunkOptimizers:
    """One optimizer per pipeline chunk (asynchronous PipeDream), seen as one for checkpoints."""

    def __init__(self, chunks: dict):
        self.chunks = chunks
        self.BUFFERS = next(iter(chunks.values())).BUFFERS

    @property
    def step_count(self):
        return next(iter(self.chunks.values())).step_count

    def state_dict(self):
        out = {}
        for o in self.chunks.values():
            out.update(o.state_dict())
        return out

    def load_state_dict(self, state):
        for o in self.chunks.values():
            o.load_state_dict({p.name: state[p.name] for p in o.params})


class Trainer:
    """This rank's model shard, executor, gradient sync and optimizer.

    ``schedule``: the one ``preflight`` built and checked (built here when not given, for
    callers that skip preflight).
    """

    def __init__(self, cfg: Config, grid, tracer: Tracer, backend: Backend, data_path=None,
                 schedule=None):
        self.cfg, self.grid, self.tracer, self.backend = cfg, grid, tracer, backend
        p = cfg.parallel
        self.tp = tp_context(grid, p)  # 1D (Megatron) or 2D (parallel.tp_mode)
        self.model = build_model(cfg.model, backend, seed=cfg.train.seed, tp=self.tp)
        if schedule is None:
            from .preflight import make_schedule

            schedule = make_schedule(cfg)
        self.schedule = schedule
        self.bounds = chunk_bounds(cfg, self.model, self.schedule)
        self.chunks = build_chunks(self.model, self.bounds, grid.pp_rank, p.pp,
                                   rank_of=self.schedule.rank_of)
        self.params = self.model.params(self.chunks.values())
        # tied embeddings: the head shares the table; params() de-duplicates by identity
        chunk_params = {c: ch.params() for c, ch in self.chunks.items()}
        self.sync = GradSync(chunk_params, grid.dp_comm, backend, self.tp, bucket_mb=p.bucket_mb,
                             overlap=p.overlap_grad_sync, zero1=p.zero1)
        self.continuous = bool(getattr(p, "continuous", False))
        self.asynchronous = bool(self.schedule.asynchronous) or self.continuous
        if self.asynchronous:
            # PipeDream: each chunk steps on its own, once per micro-batch
            self.opt = ChunkOptimizers({c: make_optimizer(cfg, ps)
                                        for c, ps in chunk_params.items()})
        else:
            self.opt = make_optimizer(cfg, self.sync.optimizer_params(self.params))
        # gradients ready: the executor calls GradSync directly (PipeDream reduces per update)
        self.executor = PipelineExecutor(
            self.model, self.chunks, self.schedule, grid.pp_rank, comm=grid.pp_comm,
            tracer=tracer, recompute=p.recompute, backend=backend,
            on_grads_ready=None if self.asynchronous else self.sync.chunk_ready,
            on_update=self._async_update if self.asynchronous else None,
            on_unit_ready=self.sync.unit_ready if self.sync.overlap else None)
        self.eval_executor = None
        self.batches = Batches(cfg, data_path)
        self.step = 0
        # PipeDream-2BW: the gradients of step k are taken at the weights before step k-1's
        # update (double buffering) and applied to the current ones: one step of delay
        self.delayed = self.schedule.kind == "pipedream-2bw" and not self.continuous
        self.previous = None  # made at the first step (after any resume): W(-1) = W(0)
        self.segment = None  # continuous: the ContinuousRun in flight (None: drained)
        self.segment_start = self.step  # the step of micro-batch 0 of the running lists
        self._segment_schedules = {}  # steps -> the continuous schedule of that many steps
        self._mem_base = False  # mem.static / mem.base: at the first step (training/memory.py)

    # -- pieces of a step
    def _local_microbatches(self, x, y):
        return local_microbatches(self.cfg, self.backend, self.grid.dp_rank, x, y)

    def _replica_sum(self, value: float) -> float:
        """Sum a number over the tp and pp ranks of one data-parallel replica."""
        for comm in (self.grid.tp_comm, self.grid.pp_comm):
            if comm.size > 1:
                value = comm.allreduce_scalar(value, op="sum")
        return value

    def grad_norm(self) -> float:
        sq = grad_norm_sq_local(self.sync.norm_params(self.params))
        if self.sync.zero1:
            sq = self.grid.dp_comm.allreduce_scalar(sq, op="sum")
        return math.sqrt(self._replica_sum(sq))

    def _loss_share(self, losses: dict) -> float:
        """This rank's part of the batch-mean loss (the last chunk's tp rank 0 holds it)."""
        g = self.grid
        holds_loss = g.pp_rank == self.schedule.rank_of(self.schedule.n_chunks - 1)
        if holds_loss and g.tp_rank == 0:  # the last chunk's rank (rank 0 in a V)
            return sum(losses.values()) / self.cfg.parallel.microbatches / g.dp_size
        return 0.0

    def global_loss(self, losses: dict) -> float:
        """The batch-mean loss, known on every rank (reported by the last stage's tp rank 0)."""
        return self.grid.world_comm.allreduce_scalar(self._loss_share(losses), op="sum")

    def norm_and_loss(self, losses: dict) -> tuple[float, float]:
        """``grad_norm()`` and ``global_loss(losses)`` in one world all-reduce of two numbers:
        a small model's step pays per collective, not per byte. Replicas hold the same
        gradients, so only dp rank 0 adds its squares (all do with ZeRO-1: each holds a slice)."""
        g = self.grid
        sq = float(grad_norm_sq_local(self.sync.norm_params(self.params)))
        if not self.sync.zero1 and g.dp_rank != 0:
            sq = 0.0
        both = np.array([sq, self._loss_share(losses)], dtype=np.float64)
        if g.world_comm.size > 1:
            g.world_comm.allreduce(both, op="sum", inplace=True)
        return math.sqrt(float(both[0])), float(both[1])

    def forward_backward(self, until=None) -> dict:
        """Gradients of this step's batch, fully synchronised (tp partial sums and dp)."""
        cfg = self.cfg
        self.tracer.step = self.step
        if self.continuous:
            return self._continuous_step(until)
        self.segment_start = self.step
        x, y = self.batches.get("train", self.step, cfg.train.batch_size)
        xs, ys = self._local_microbatches(x, y)
        for p in self.params:
            p.zero_grad()
        self.sync.start()
        if self.delayed:  # 2BW: run on the older buffer, then the current weights come back
            if self.previous is None:
                self.previous = [p.data.copy() for p in self.params]
            current = [p.data for p in self.params]
            for p, w in zip(self.params, self.previous):
                p.data = w
        losses = self.executor.run(xs, ys)
        if self.delayed:
            for p, w in zip(self.params, current):
                p.data = w
        if not self.asynchronous:
            beat("the data-parallel gradient all-reduce")
            self.sync.finish()
        return losses

    def _continuous_step(self, until):
        """Step ``self.step`` of a continuous run, opening one (lists up to step ``until``,
        default the last) when none is in flight; the run drains after its last step."""
        from ..parallel.pipeline.check import check_schedule
        from ..parallel.pipeline.generators import build_schedule

        if self.segment is None:
            p, last = self.cfg.parallel, self.cfg.train.steps - 1
            n = max(1, min(last if until is None else until, last) - self.step + 1)
            if n not in self._segment_schedules:
                s = build_schedule(p.schedule, p.pp, p.microbatches, steps=n,
                                   vertical_sync=p.vertical_sync)
                check_schedule(s)
                # the lengths recur (the drain interval, the rest at the end); building and
                # checking is linear in the steps (~0.1 s per step at pp = m = 8)
                self._segment_schedules[n] = s
            ex = PipelineExecutor(
                self.model, self.chunks, self._segment_schedules[n], self.grid.pp_rank,
                comm=self.grid.pp_comm, tracer=self.tracer, recompute=p.recompute,
                backend=self.backend, on_update=self._async_update)
            for q in self.params:
                q.zero_grad()
            if self.schedule.kind == "pipedream-2bw" and self.previous is None:
                self.previous = [q.data.copy() for q in self.params]  # W(-1) = W(0)
            self.segment_start, self._fed = self.step, {}
            self.segment = ex.start_continuous(self._feed, older=self._older_by_chunk())
        losses = self.segment.run_step()
        if self.segment.done:
            self.segment = None
        return losses

    def _feed(self, k):
        """The local micro-batches of step k of the running lists (the trainer feeds step k+1
        while step k's are in flight); each batch is read once and dropped when done."""
        step = self.segment_start + k
        if step not in self._fed:
            x, y = self.batches.get("train", step, self.cfg.train.batch_size)
            self._fed = {s: v for s, v in self._fed.items() if s >= self.step}
            self._fed[step] = self._local_microbatches(x, y)
        return self._fed[step]

    def _older_by_chunk(self):
        """2BW's older buffer as {chunk: arrays in chunk.params() order} (None: not 2BW)."""
        if self.previous is None:
            return None
        by_id = {id(q): w for q, w in zip(self.params, self.previous)}
        return {c: [by_id[id(q)] for q in ch.params()] for c, ch in self.chunks.items()}

    def older_weights(self):
        """{parameter name: 2BW's older weights} for checkpoints (None: no older buffer).
        Only between continuous runs (drained), where the next step needs exactly these."""
        if self.schedule.kind != "pipedream-2bw":
            return None
        prev = self.previous or [q.data for q in self.params]  # W(-1) = W(0) before step 0
        return {q.name: w for q, w in zip(self.params, prev)}

    def load_older(self, arrays: dict):
        """Resume: 2BW's older buffer as a checkpoint saved it (``older_weights``)."""
        xp = self.backend.xp
        self.previous = [xp.array(arrays[q.name], dtype=q.data.dtype) for q in self.params]

    def _async_update(self, mb, c):
        """PipeDream: apply micro-batch mb's gradient to chunk c now (synchronised over tp, dp).
        Continuous 2BW: mb is its step's last; the step's gradient (taken on the older buffer)
        goes to the current weights, which first become the chunk's older buffer."""
        step = self.segment_start + mb // self.cfg.parallel.microbatches
        ps = self.chunks[c].params()
        if self.continuous and self.schedule.kind == "pipedream-2bw":
            keep = {id(q): q.data.copy() for q in ps}
            self.previous = [keep.get(id(q), w) for q, w in zip(self.params, self.previous)]
        self.sync.reduce_now(c)
        with self.tracer.region("OPT", mb=mb % self.cfg.parallel.microbatches, chunk=c):
            self.opt.chunks[c].step(step_lr(self.cfg, step))
        if self.continuous and self.schedule.kind == "pipedream-2bw":
            for q in ps:
                q.zero_grad()

    def update(self, losses: dict | None = None) -> tuple[float, float]:
        """Clip by the global norm and step the optimizer. Returns (grad norm, lr). Given the
        step's ``losses``, their global mean comes with the norm (``step_loss``)."""
        t = self.cfg.train
        with self.tracer.region("OPT"):
            beat("the gradient-norm (and loss) all-reduce and the optimizer step")
            if losses is None:
                norm = self.grad_norm()
            else:
                norm, self.step_loss = self.norm_and_loss(losses)
            if t.grad_clip > 0:
                clip_grads_(self.sync.norm_params(self.params) if self.sync.zero1
                            else self.params, t.grad_clip, norm)
            lr = step_lr(self.cfg, self.step)
            if self.delayed:  # the current weights become the older buffer
                for buf, p in zip(self.previous, self.params):
                    buf[...] = p.data
            self.opt.step(lr)
            self.sync.after_step()
        return norm, lr

    def train_step(self, until=None) -> dict:
        """One step. ``until``: continuous schedules only, the last step of the run that opens
        here (the next drain point: an evaluation, a checkpoint; default the last step)."""
        cfg, tr = self.cfg, self.tracer
        tr.step = self.step
        if not self._mem_base:  # after all set-up (resume, rank 0's GEMM peak): the base
            record_setup(tr, self, self.backend)
            self._mem_base = True
        t0 = tr.now()
        start = time.perf_counter()
        losses = self.forward_backward(until)
        if self.asynchronous:  # the executor already applied every micro-batch's update
            norm, lr = float("nan"), step_lr(cfg, self.step)
        else:
            norm, lr = self.update(losses)
        if self.asynchronous:
            beat("the loss all-reduce")
            loss = self.global_loss(losses)
        else:
            loss = self.step_loss  # came with the norm (``update``)
        self.backend.synchronize()
        tr.record("STEP", t0, tr.now())
        tr.record("mem.peak", tr.now(), tr.now(), nbytes=step_peak(self.backend))
        elapsed = time.perf_counter() - start
        tokens = cfg.train.batch_size * (cfg.train.seq_len if cfg.model.kind == "gpt" else 1)
        self.step += 1
        return {"step": self.step - 1, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens": tokens, "step_time": elapsed}

    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` batches (forward only, through the
        pipeline)."""
        cfg = self.cfg
        if self.segment is not None:
            raise RuntimeError("evaluation needs a drained pipeline: a continuous schedule is in "
                               "flight (train_step(until=...) must end its run first)")
        if self.eval_executor is None:
            s = forward_only_schedule(cfg.parallel.pp, cfg.parallel.microbatches,
                                      self.schedule.virtual_stages, self.schedule.placement)
            self.eval_executor = PipelineExecutor(
                self.model, self.chunks, s, self.grid.pp_rank, comm=self.grid.pp_comm,
                tracer=None, backend=self.backend)
        total = 0.0
        for i in range(cfg.train.eval_batches):
            x, y = self.batches.get("val", i, cfg.train.batch_size)
            xs, ys = self._local_microbatches(x, y)
            losses = self.eval_executor.run(xs, ys, forward_only=True)
            total += self.global_loss(losses)
        return total / cfg.train.eval_batches
