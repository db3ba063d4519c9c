"""The training loop: config -> grid -> model shard -> schedule -> optimizer -> tracer.

The same loop runs one rank (``python``, ``mpiexec -n 1``) and any dp x pp x tp grid. Each step:
the global batch (deterministic from seed and step) is cut into this replica's rows and into
micro-batches; the pipeline executor runs this rank's action list; sequence-parallel partial
gradients are reduced over tp and data-parallel buckets over dp; the global gradient norm is
clipped; the optimizer steps. Every rank records its events; the dump is flushed now and then
and written at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .backend import Backend
from .config import Config, ConfigError, validate
from .models import build_model
from .nn.optim import SGD, AdamW, clip_grads_, lr_at
from .parallel.data import GradSync
from .parallel.pipeline.executor import PipelineExecutor, build_chunks
from .parallel.tensor import TPContext, sync_partial_grads
from .trace import Tracer, check_writable


def make_schedule(cfg: Config):
    from .parallel.pipeline.actions import Schedule
    from .parallel.pipeline.check import check_schedule
    from .parallel.pipeline.generators import build_schedule

    p = cfg.parallel
    if p.schedule_file:
        s = Schedule.load(p.schedule_file)
        if (s.pp, s.microbatches) != (p.pp, p.microbatches):
            raise ConfigError(f"schedule file {p.schedule_file} is for pp={s.pp}, microbatches="
                              f"{s.microbatches}; the run has pp={p.pp}, microbatches="
                              f"{p.microbatches}")
    else:
        s = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    check_schedule(s)
    return s


def chunk_bounds(cfg: Config, model, schedule) -> dict:
    from .parallel.pipeline.partition import chunk_layers

    p = cfg.parallel
    n = len(model.units)
    kw = {"method": p.partition}
    if p.partition in ("params", "cost"):
        kw["weights"] = [sum(q.size * q.tp_size if q.spec.axis is not None else q.size
                             for q in u.params()) + 1 for u in model.units]
    if p.partition == "explicit":
        kw["boundaries"] = list(p.boundaries)
    return chunk_layers(n, schedule.pp, schedule.virtual, **kw)


def preflight(cfg: Config, world_size: int) -> None:
    """Every check that needs no MPI work, on every rank, before anything starts."""
    validate(cfg, world_size)
    if cfg.train.device == "cuda":
        from .backend import cupy_available

        ok, why = cupy_available()
        if not ok:
            raise ConfigError(f"train.device = cuda but {why}: install the gpu extra "
                              f"(pip install -e '.[gpu]') on a GPU node, or use --device cpu")
    try:
        make_schedule(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.run.trace:
        try:
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory {cfg.out_dir}: {exc}; pass "
                              f"--out DIR with a writable location") from None
        try:
            check_writable(cfg.out_dir / "trace.h5")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


class Batches:
    """Deterministic global batches for (seed, step), whatever the grid."""

    def __init__(self, cfg: Config, path=None):
        self.cfg = cfg
        m = cfg.model
        if m.kind == "gpt":
            from .datasets import TokenDataset

            self.ds = TokenDataset(path)
            if self.ds.vocab_size > m.vocab_size:
                raise ConfigError(f"data file {path} has vocabulary {self.ds.vocab_size} but "
                                  f"model.vocab_size = {m.vocab_size}: raise vocab_size")
        else:
            from .datasets import synthetic_classification, synthetic_regression

            n = 4096
            if m.task == "classification":
                self.X, self.Y = synthetic_classification(n, m.sizes[0], m.sizes[-1],
                                                          cfg.train.seed)
            else:
                self.X, self.Y = synthetic_regression(n, m.sizes[0], m.sizes[-1], cfg.train.seed)
            cut = int(0.9 * n)
            self.split = {"train": (self.X[:cut], self.Y[:cut]),
                          "val": (self.X[cut:], self.Y[cut:])}

    def get(self, split, step, batch_size):
        t = self.cfg.train
        if self.cfg.model.kind == "gpt":
            return self.ds.get_batch(split, step, batch_size, t.seq_len, t.seed)
        X, Y = self.split[split]
        rng = np.random.default_rng([t.seed, step, 0 if split == "train" else 1])
        rows = rng.integers(0, len(X), size=batch_size)
        return X[rows], Y[rows]


def _split_rows(a, parts, index=None):
    k = a.shape[0] // parts
    if index is not None:
        return a[index * k:(index + 1) * k]
    return [a[i * k:(i + 1) * k] for i in range(parts)]


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
    def __init__(self, cfg: Config, grid, tracer: Tracer, backend: Backend, data_path=None):
        self.cfg, self.grid, self.tracer, self.backend = cfg, grid, tracer, backend
        p = cfg.parallel
        self.tp = TPContext.from_comm(grid.tp_comm, p.sequence_parallel)
        self.model = build_model(cfg.model, backend, seed=cfg.train.seed, tp=self.tp)
        self.schedule = make_schedule(cfg)
        self.bounds = chunk_bounds(cfg, self.model, self.schedule)
        self.chunks = build_chunks(self.model, self.bounds, grid.pp_rank, p.pp)
        self.params = self.model.params(self.chunks.values())
        # tied embeddings: the head shares the table; params() de-duplicates by identity
        chunk_params = {c: ch.params() for c, ch in self.chunks.items()}
        self.sync = GradSync(chunk_params, grid.dp_comm if p.dp > 1 else None, backend,
                             bucket_mb=p.bucket_mb, overlap=p.overlap_grad_sync, zero1=p.zero1)
        self.asynchronous = bool(self.schedule.asynchronous)
        if self.asynchronous:
            # PipeDream: each chunk steps on its own, once per micro-batch
            self.opt = ChunkOptimizers({c: self._make_optimizer(ps)
                                        for c, ps in chunk_params.items()})
        else:
            self.opt = self._make_optimizer(self.sync.optimizer_params(self.params))
        self.executor = PipelineExecutor(
            self.model, self.chunks, self.schedule, grid.pp_rank,
            comm=grid.pp_comm if p.pp > 1 else None, tracer=tracer, recompute=p.recompute,
            backend=backend, on_grads_ready=self._chunk_grads_ready,
            on_update=self._async_update if self.asynchronous else None,
            on_unit_ready=self._unit_grads_ready if self.sync.overlap else None)
        self.eval_executor = None
        self.batches = Batches(cfg, data_path)
        self.step = 0
        self._ready, self._partial_done = set(), set()

    def _make_optimizer(self, params):
        t = self.cfg.train
        if t.optimizer == "adamw":
            return AdamW(params, t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                         weight_decay=t.weight_decay)
        return SGD(params, t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    # -- pieces of a step
    def _local_microbatches(self, x, y):
        g, p = self.grid, self.cfg.parallel
        x, y = _split_rows(x, p.dp, g.dp_rank), _split_rows(y, p.dp, g.dp_rank)
        xp, dtype = self.backend.xp, self.backend.dtype
        if self.cfg.model.kind == "mlp":
            x = xp.asarray(x, dtype=dtype)
            if self.cfg.model.task == "regression":
                y = xp.asarray(y, dtype=dtype)
        else:
            x = xp.asarray(x)
        y = xp.asarray(y)
        m = p.microbatches
        return _split_rows(x, m), _split_rows(y, m)

    def _replica_sum(self, value: float) -> float:
        """Sum a number over the tp and pp ranks of one data-parallel replica."""
        g = self.grid
        if g.tp_size > 1:
            value = g.tp_comm.allreduce_scalar(value, op="sum")
        if g.pp_size > 1:
            value = g.pp_comm.allreduce_scalar(value, op="sum")
        return value

    def grad_norm(self) -> float:
        from .nn.optim import grad_norm_sq_local

        sq = grad_norm_sq_local(self.sync.norm_params(self.params))
        if self.sync.zero1:
            sq = self.grid.dp_comm.allreduce_scalar(sq, op="sum")
        return math.sqrt(self._replica_sum(sq))

    def global_loss(self, losses: dict) -> float:
        """The batch-mean loss, known on every rank (reported by the last stage's tp rank 0)."""
        g = self.grid
        mine = 0.0
        if g.is_last_stage and g.tp_rank == 0:
            mine = sum(losses.values()) / self.cfg.parallel.microbatches / g.dp_size
        return g.world_comm.allreduce_scalar(mine, op="sum")

    def forward_backward(self) -> dict:
        """Gradients of this step's batch, fully synchronised (tp partial sums and dp)."""
        cfg = self.cfg
        self.tracer.step = self.step
        x, y = self.batches.get("train", self.step, cfg.train.batch_size)
        xs, ys = self._local_microbatches(x, y)
        for p in self.params:
            p.zero_grad()
        self.sync.start()
        self._ready, self._partial_done = set(), set()
        losses = self.executor.run(xs, ys)
        if not self.asynchronous:
            for c in self.chunks:
                self._chunk_grads_ready(c)  # no-op for chunks the executor already reported
            self.sync.finish()
        return losses

    def _async_update(self, mb, c):
        """PipeDream: apply micro-batch mb's gradient to chunk c now (synchronised over tp, dp)."""
        params = self.chunks[c].params()
        sync_partial_grads(params, self.tp)
        if self.grid.dp_size > 1:
            for p in params:
                self.grid.dp_comm.allreduce(p.grad, op="mean", inplace=True)
        t = self.cfg.train
        lr = lr_at(self.step, t.lr, min(t.warmup_steps, t.steps - 1), t.steps, t.min_lr)
        with self.tracer.region("OPT", mb=mb, chunk=c):
            self.opt.chunks[c].step(lr)

    def _unit_grads_ready(self, c, unit):
        """During a chunk's last backward: this unit's gradients are final (dp overlap)."""
        params = unit.params()
        sync_partial_grads(params, self.tp)
        self._partial_done.update(id(p) for p in params)
        self.sync.unit_ready(c, params)

    def _chunk_grads_ready(self, c):
        """A chunk's gradients are final: reduce sequence-parallel partial sums over tp, then
        start the data-parallel reduction of its buckets (in this order: the dp reduction runs
        in the background on the same buffers)."""
        if c in self._ready or self.asynchronous:
            return
        self._ready.add(c)
        sync_partial_grads([p for p in self.chunks[c].params() if id(p) not in self._partial_done],
                           self.tp)
        self.sync.chunk_ready(c)

    def update(self) -> tuple[float, float]:
        """Clip by the global norm and step the optimizer. Returns (grad norm, lr)."""
        t = self.cfg.train
        with self.tracer.region("OPT"):
            norm = self.grad_norm()
            if t.grad_clip > 0:
                clip_grads_(self.sync.norm_params(self.params) if self.sync.zero1
                            else self.params, t.grad_clip, norm)
            # a short run (--steps 3 on a config made for 200) keeps a warm-up that fits it
            lr = lr_at(self.step, t.lr, min(t.warmup_steps, t.steps - 1), t.steps, t.min_lr)
            self.opt.step(lr)
            self.sync.after_step()
        return norm, lr

    def train_step(self) -> dict:
        cfg, tr = self.cfg, self.tracer
        tr.step = self.step
        t0 = tr.now()
        start = time.perf_counter()
        losses = self.forward_backward()
        if self.asynchronous:  # the executor already applied every micro-batch's update
            t = cfg.train
            norm = float("nan")
            lr = lr_at(self.step, t.lr, min(t.warmup_steps, t.steps - 1), t.steps, t.min_lr)
        else:
            norm, lr = self.update()
        loss = self.global_loss(losses)
        self.backend.synchronize()
        tr.record("STEP", t0, tr.now())
        elapsed = time.perf_counter() - start
        tokens = cfg.train.batch_size * (cfg.train.seq_len if cfg.model.kind == "gpt" else 1)
        self.step += 1
        return {"step": self.step - 1, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens": tokens, "step_time": elapsed}

    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` batches (forward only, through the
        pipeline)."""
        cfg = self.cfg
        if self.eval_executor is None:
            from .parallel.pipeline.executor import forward_only_schedule

            s = forward_only_schedule(cfg.parallel.pp, cfg.parallel.microbatches,
                                      self.schedule.virtual)
            self.eval_executor = PipelineExecutor(
                self.model, self.chunks, s, self.grid.pp_rank,
                comm=self.grid.pp_comm if cfg.parallel.pp > 1 else None, tracer=None,
                backend=self.backend)
        total = 0.0
        for i in range(cfg.train.eval_batches):
            x, y = self.batches.get("val", i, cfg.train.batch_size)
            xs, ys = self._local_microbatches(x, y)
            losses = self.eval_executor.run(xs, ys, forward_only=True)
            total += self.global_loss(losses)
        return total / cfg.train.eval_batches


def _progress(i, n, rec, start, stream):
    width = 24
    done = int(width * (i + 1) / n)
    tok_s = rec["tokens"] / max(rec["step_time"], 1e-9)
    line = (f"\r[{'#' * done}{'.' * (width - done)}] step {i + 1}/{n} loss {rec['loss']:.4f} "
            f"{tok_s:,.0f} tok/s {time.perf_counter() - start:.0f}s")
    stream.write(line if stream.isatty() else line[1:] + "\n")
    stream.flush()


def run(cfg: Config) -> dict:
    """Train as the config says, on whatever MPI world this process belongs to."""
    from .mpi import failfast
    from .mpi.dump import dump_trace
    from .mpi.grid import ProcessGrid, bind_gpu
    from .mpi.world import world_size_and_rank

    world_size, world_rank = world_size_and_rank()
    preflight(cfg, world_size)  # every rank checks; all fail alike, before any MPI traffic
    failfast.install()
    if cfg.train.device == "cuda":
        bind_gpu()
    backend = Backend(cfg.train.device, cfg.train.dtype)
    tracer = Tracer(enabled=cfg.run.trace, backend=backend, rank=world_rank)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, p.tp, order=p.order, tracer=tracer, backend=backend)
    out = cfg.out_dir
    data_path = None
    if cfg.model.kind == "gpt":
        data_path = _prepare_data(cfg, grid)
    trainer = Trainer(cfg, grid, tracer, backend, data_path)
    from .checkpoint import maybe_resume, save_checkpoint

    maybe_resume(trainer)
    grid.world_comm.barrier()
    tracer.reset_clock()
    lead = grid.rank == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        print(f"mpipar: {cfg.model.kind} with {trainer.model.n_params_full:,} parameters on "
              f"dp={p.dp} pp={p.pp} tp={p.tp} ({p.schedule}, {p.microbatches} micro-batches), "
              f"{cfg.train.dtype} on {cfg.train.device}; run dir {out}", flush=True)
    file_attrs = {"config": cfg.to_dict(),
                  "peak_flops": _device_peak(cfg, grid, backend) if cfg.run.trace else float("nan")}
    history, val_loss = [], float("nan")
    start = time.perf_counter()
    for i in range(trainer.step, cfg.train.steps):
        rec = trainer.train_step()
        val = float("nan")
        last = i + 1 == cfg.train.steps
        if cfg.train.eval_interval and ((i + 1) % cfg.train.eval_interval == 0 or last):
            val = val_loss = trainer.evaluate()
        rec["val_loss"] = val
        tracer.add_metrics(**rec)
        history.append(rec)
        every = cfg.run.log_interval if not sys.stdout.isatty() else 1
        if lead and cfg.run.progress and ((i + 1) % max(every, 1) == 0 or last):
            _progress(i, cfg.train.steps, rec, start, sys.stdout)
            if not math.isnan(val):
                print(f"  val loss {val:.4f}", flush=True)
        ci = cfg.run.checkpoint_interval
        if ci and (i + 1) % ci == 0 and not last:
            save_checkpoint(trainer, out / "checkpoints")
        if cfg.run.trace and cfg.run.flush_interval and (i + 1) % cfg.run.flush_interval == 0:
            dump_trace(tracer, grid, out / "trace.h5", file_attrs)
    if cfg.run.checkpoint_final or cfg.run.checkpoint_interval:
        save_checkpoint(trainer, out / "checkpoints")
    summary = _summary(cfg, trainer, history, val_loss)
    if cfg.run.trace:
        dump_trace(tracer, grid, out / "trace.h5", dict(file_attrs, complete=True))
    if lead:
        _write_json(out / "metrics.json", summary)
        _print_summary(summary)
    return summary


def _device_peak(cfg, grid, backend) -> float:
    """The GEMM peak of one device for MFU (see docs/dump_schema.md), measured on world rank 0.

    On a GPU: the rate of a large matrix product there. On the CPU the host is the device: the
    rate one rank reaches with its BLAS threads, times the cores this host's ranks use (capped at
    the host's cores): what all of them together could reach.
    """
    if grid.rank != 0:
        return float("nan")
    from .bench.gemm import measure_gemm_peak

    try:
        rate = measure_gemm_peak(backend.dtype, n=1024 if backend.is_gpu else 512, seconds=0.2,
                                 xp=backend.xp)
    except Exception:  # a missing bench dependency must not stop training
        return float("nan")
    if backend.is_gpu:
        return rate
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
                  or (os.cpu_count() or 1))
    here = sum(1 for h in grid.hostnames if h == grid.hostname)
    return rate / threads * min(here * threads, os.cpu_count() or 1)


def _prepare_data(cfg, grid):
    from .datasets import ensure_corpus

    path = cfg.data.path or None
    if grid.rank == 0 and path is None:
        ensure_corpus(None, max_bytes=cfg.data.max_bytes)
    grid.world_comm.barrier()
    if path is None:
        from .datasets import default_corpus_path

        path = default_corpus_path()
    return path


def _summary(cfg, trainer, history, val_loss):
    measured = history[1:] if len(history) > 1 else history
    tok_s = (sum(r["tokens"] for r in measured) / max(sum(r["step_time"] for r in measured), 1e-9)
             if measured else float("nan"))
    s = {
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "losses": [r["loss"] for r in history],
        "val_loss": val_loss,
        "tokens_per_s": tok_s,
        "steps": trainer.step,
        "params": trainer.model.n_params_full,
        "grid": {"dp": cfg.parallel.dp, "pp": cfg.parallel.pp, "tp": cfg.parallel.tp},
        "schedule": cfg.parallel.schedule,
        "microbatches": cfg.parallel.microbatches,
    }
    if cfg.model.kind == "gpt":
        s["unigram_val_loss"] = trainer.batches.ds.unigram_val_loss
    return s


def _print_summary(s):
    line = (f"done: {s['steps']} steps, final train loss {s['final_loss']:.4f}, "
            f"val loss {s['val_loss']:.4f}")
    if "unigram_val_loss" in s:
        line += f" (unigram baseline {s['unigram_val_loss']:.4f})"
    line += f", {s['tokens_per_s']:,.0f} tokens/s"
    print(line, flush=True)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=float) + "\n")
    os.replace(tmp, path)
