"""One training step on this rank: forward / backward through the pipeline executor, gradient
synchronisation (tp partial sums, dp buckets), clipping by the global norm, the optimizer step.

The executor reports gradients straight to ``GradSync`` (its ``unit_ready`` / ``chunk_ready``);
the trainer wires them up and steps. How a step's gradients are taken and applied depends on the
training mode (synchronous, PipeDream-2BW, PipeDream, continuous): one class each in ``steps``,
chosen once from the resolved run (``resolved.ResolvedRun.mode``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..backend import Backend
from ..config import Config
from ..models import build_model
from ..nn.optim import LocalGradNorm
from ..parallel.data import GradSync
from ..parallel.pipeline.executor import PipelineExecutor, build_chunks
from ..parallel.tensor_nd import tp_context
from ..trace import Tracer
from .batches import Batches, local_microbatches
from .memory import record_setup, step_peak
from .resolved import ResolvedRun, resolve
from .steps import STEP_CLASSES


class Trainer:
    """This rank's model shard, executor, gradient sync, optimizer and training mode.

    ``resolved``: the run ``preflight`` resolved (resolved here when not given, for callers that
    skip preflight); its ``cfg`` must be ``cfg``.
    """

    def __init__(self, cfg: Config, grid, tracer: Tracer, backend: Backend, data_path=None,
                 resolved: ResolvedRun | None = None):
        if resolved is not None and resolved.cfg is not cfg:
            raise ValueError("Trainer: the resolved run was made from another config")
        self.cfg, self.grid, self.tracer, self.backend = cfg, grid, tracer, backend
        self.run = run = resolved or resolve(cfg)
        p = cfg.parallel
        self.tp = tp_context(grid, p)  # 1D (Megatron) or 2D / 2.5D / 3D (parallel.tp_mode)
        self.model = build_model(cfg.model, backend, seed=cfg.train.seed, tp=self.tp)
        self.schedule = run.schedule
        self.chunks = build_chunks(self.model, run.bounds, grid.pp_rank, p.pp,
                                   rank_of=run.rank_of)
        self.params = self.model.params(self.chunks.values())
        # tied embeddings: the head shares the table; params() de-duplicates by identity
        chunk_params = {c: ch.params() for c, ch in self.chunks.items()}
        self.sync = GradSync(chunk_params, grid.dp_comm, backend, self.tp, bucket_mb=p.bucket_mb,
                             overlap=p.overlap_grad_sync, zero1=p.zero1)
        self._norm_params = None  # norm_params, listed at the first step
        self.stop_signals = None  # the run's signals.StopSignals (agreed in a step's reduction)
        self._stop_agreed = None  # the stop the last step's reduction agreed on (take_stop)
        self.mode = STEP_CLASSES[run.mode](self)
        self.opt = self.mode.optimizer()
        # gradients ready: the executor calls GradSync directly (PipeDream reduces per update)
        self.executor = PipelineExecutor(
            self.model, self.chunks, self.schedule, grid.pp_rank, comm=grid.pp_comm,
            tracer=tracer, recompute=p.recompute, backend=backend,
            on_unit_ready=self.sync.unit_ready if self.sync.overlap else None,
            **self.mode.callbacks())
        self.eval_executor = None
        self.batches = Batches(cfg, data_path)
        self.step = 0
        # fixed for the run, so not looked up per step: whether this rank reports the loss (the
        # last chunk's tp rank 0), and whether a step must wait for queued GPU work
        self._holds_loss = (grid.pp_rank == run.rank_of(self.schedule.n_chunks - 1)
                            and grid.tp_rank == 0)
        self._on_gpu = backend.is_gpu
        self._mem_base = False  # mem.static / mem.base: at the first step (training/memory.py)

    # -- pieces of a step
    def local_microbatches(self, x, y, replica_rows=False):
        return local_microbatches(self.run, self.backend, self.grid.dp_rank, x, y, replica_rows)

    def local_batch(self, split, step):
        """This replica's micro-batches of (split, step): only its own rows are gathered."""
        g = self.grid
        x, y = self.batches.get(split, step, self.cfg.train.batch_size, self.cfg.parallel.dp,
                                g.dp_rank, inputs=0 in self.chunks)  # chunk 0 reads them
        return local_microbatches(self.run, self.backend, g.dp_rank, x, y, replica_rows=True)

    def _replica_sum(self, value: float) -> float:
        """Sum a number over the tp and pp ranks of one data-parallel replica."""
        for comm in (self.grid.tp_comm, self.grid.pp_comm):
            if comm.size > 1:
                value = comm.allreduce_scalar(value, op="sum")
        return value

    @property
    def norm_params(self) -> list:
        """The tensors whose squares make this rank's share of the gradient norm: the same
        every step (the parameters and ZeRO-1's slices are made once), so listed once."""
        if self._norm_params is None:
            self._norm_params = self.sync.norm_params(self.params)
            self._norm_sq = LocalGradNorm(self._norm_params)
        return self._norm_params

    def norm_sq_local(self) -> float:
        """This rank's share of the squared gradient norm (``grad_norm_sq_local`` of
        ``norm_params``, its per-tensor work prepared once: the same bits)."""
        if self._norm_params is None:
            _ = self.norm_params  # lists them, and makes their LocalGradNorm
        return self._norm_sq()

    @property
    def norm_wanted(self) -> bool:
        """Whether a step computes the gradient norm: only to clip by it (``train.grad_clip``
        > 0), as Megatron-LM does; without clipping a step's ``grad_norm`` is NaN."""
        return self.cfg.train.grad_clip > 0

    def grad_norm(self) -> float:
        if not self.norm_wanted:
            return math.nan
        sq = self.norm_sq_local()
        if self.sync.zero1:
            sq = self.grid.dp_comm.allreduce_scalar(sq, op="sum")
        return math.sqrt(self._replica_sum(sq))

    def _loss_share(self, losses: dict) -> float:
        """This rank's part of the batch-mean loss (the last chunk's tp rank 0 holds it)."""
        if self._holds_loss:  # the last chunk's rank (rank 0 in a V), its tp rank 0
            return sum(losses.values()) / self.run.microbatches / self.grid.dp_size
        return 0.0

    def global_loss(self, losses: dict) -> float:
        """The batch-mean loss, known on every rank (reported by the last stage's tp rank 0)."""
        return self.grid.world_comm.allreduce_scalar(self._loss_share(losses), op="sum")

    def norm_and_loss(self, losses: dict) -> tuple[float, float]:
        """``grad_norm()`` and ``global_loss(losses)`` in one world all-reduce of a few numbers:
        a small model's step pays per collective, not per byte. Replicas hold the same
        gradients, so only dp rank 0 adds its squares (all do with ZeRO-1: each holds a slice)."""
        g = self.grid
        wanted = self.norm_wanted
        # a replica's squares would be thrown away: they are not computed
        sq = self.norm_sq_local() if wanted and (self.sync.zero1 or g.dp_rank == 0) else 0.0
        # the stop agreement rides on the same all-reduce (summed per-signal counts): a small
        # model's step then meets the other ranks once, not twice (``take_stop``)
        sig = self.stop_signals
        both = np.array([sq, self._loss_share(losses), *(sig.shares() if sig else ())],
                        dtype=np.float64)
        if g.world_comm.size > 1:
            g.world_comm.allreduce(both, op="sum", inplace=True)
        if sig is not None:
            self._stop_agreed = sig.agree_from(both[2:])
        return math.sqrt(float(both[0])) if wanted else math.nan, float(both[1])

    def take_stop(self):
        """The stop signal every rank agreed on in the last step's norm-and-loss reduction
        (0: none), or None when that step had no such reduction (then ``StopSignals.agree``).
        Read once: the next step agrees again."""
        agreed, self._stop_agreed = self._stop_agreed, None
        return agreed

    def forward_backward(self, until=None) -> dict:
        """This step's gradients (``until``: continuous runs, the last step of a run opening
        here); synchronous modes: fully synchronised over tp and dp."""
        self.tracer.step = self.step
        return self.mode.forward_backward(until)

    def update(self, losses: dict | None = None) -> tuple[float, float]:
        """Clip by the global norm and step the optimizer (modes with a flush). Returns (grad
        norm, lr). Given the step's ``losses``, their global mean comes with the norm
        (``step_loss``)."""
        return self.mode.update(losses)

    def settle(self, rec: dict) -> list:
        """The records of the steps whose metrics are known now, oldest first: ``rec`` itself,
        or in a continuous run (``metrics_lag`` > 0) those whose lagged reduction was read in
        this step, each with ``stop``, the agreed stop signal (``lagged``)."""
        return self.mode.settle(rec)

    @property
    def metrics_lag(self) -> int:
        """Steps between a step and the reading of its loss and stop agreement."""
        return self.mode.metrics_lag

    @property
    def drained(self) -> bool:
        """No continuous schedule in flight (evaluation, checkpoints and stopping need it)."""
        return self.mode.drained

    def older_weights(self):
        """{parameter name: 2BW's older weights} for checkpoints (None: no older buffer).
        Only between continuous runs (drained), where the next step needs exactly these."""
        return None if self.mode.older is None else self.mode.older.named()

    def load_older(self, arrays: dict):
        """Resume: 2BW's older buffer as a checkpoint saved it (``older_weights``)."""
        self.mode.older.load(arrays, self.backend.xp)

    def train_step(self, until=None) -> dict:
        """One step. ``until``: continuous schedules only, the last step of the run that opens
        here (the next drain point: an evaluation, a checkpoint; default the last step)."""
        cfg, tr = self.cfg, self.tracer
        tr.step = self.step
        if not self._mem_base:  # after all set-up (resume, rank 0's GEMM peak): the base
            record_setup(tr, self, self.backend)
            self._mem_base = True
        start = time.perf_counter()
        t0 = start - tr.t0  # tr.now() at the same instant
        loss, norm, lr = self.mode.conclude(self.forward_backward(until))
        if self._on_gpu:
            self.backend.synchronize()
        if tr.enabled:  # untraced, no /proc read for a peak that nothing would record
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
        if not self.drained:
            raise RuntimeError("evaluation needs a drained pipeline: a continuous schedule is in "
                               "flight (train_step(until=...) must end its run first)")
        if self.eval_executor is None:
            self.eval_executor = PipelineExecutor(
                self.model, self.chunks, self.run.eval_schedule, self.grid.pp_rank,
                comm=self.grid.pp_comm, tracer=None, backend=self.backend)
        total = 0.0
        for i in range(cfg.train.eval_batches):
            xs, ys = self.local_batch("val", i)
            losses = self.eval_executor.run(xs, ys, forward_only=True)
            total += self.global_loss(losses)
        return total / cfg.train.eval_batches

