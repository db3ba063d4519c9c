"""The run: config -> grid -> trainer, then the steps with evaluation, checkpoints, dump flushes,
progress and the summary.

The same loop runs one rank (``python``, ``mpiexec -n 1``) and any dp x pp x tp grid. Every rank
records its events; the dump is flushed now and then and written at the end.
"""

from __future__ import annotations

import math
import os
import sys
import time
from array import array

from ..backend import Backend
from ..config import Config
from ..files import write_json_atomic
from ..progress import beat, begin_step
from ..trace import Tracer, rewind_dump
from .preflight import preflight
from .signals import StopSignals
from .trainer import Trainer


class Preempted(Exception):
    """Every rank stopped at the same step on SIGTERM / SIGUSR1, after a checkpoint and a dump
    flush. ``mpipar train`` exits with ``failfast.EXIT_PREEMPTED``."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped at step {step} on signal {signum}")
        self.step, self.signum = step, signum


def check_run_settings(cfg: Config) -> None:
    """Resolve ``run.resume = "auto"`` (the latest checkpoint of the run directory, if any),
    before any work. (Every field's range, run.watchdog_s's included, is config.RULES'.)"""
    if cfg.run.resume == "auto":
        latest = cfg.out_dir / "checkpoints" / "latest"
        cfg.run.resume = "latest" if latest.is_file() else ""


def run(cfg: Config, resolved=None) -> dict:
    """Train as the config says, on whatever MPI world this process belongs to.
    ``resolved``: the run ``preflight`` resolved (``mpipar train`` runs preflight before this)."""
    from ..checkpoint import maybe_resume, save_checkpoint
    from ..mpi import ProcessGrid, bind_gpu, dump_trace, failfast, world_size_and_rank

    world_size, world_rank = world_size_and_rank()
    if resolved is None:  # every rank checks; all fail alike, before any MPI traffic
        resolved = preflight(cfg, world_size)
        check_run_settings(cfg)
    failfast.install()
    if cfg.train.device == "cuda":
        bind_gpu()
    backend = Backend(cfg.train.device, cfg.train.dtype)
    tracer = Tracer(enabled=cfg.run.trace, backend=backend, rank=world_rank)
    p = cfg.parallel
    grid = ProcessGrid(p.dp, p.pp, p.tp, order=p.order, tracer=tracer, backend=backend)
    out = cfg.out_dir
    data_path = prepare_data(cfg, grid) if cfg.model.kind == "gpt" else None
    trainer = Trainer(cfg, grid, tracer, backend, data_path, resolved=resolved)
    maybe_resume(trainer)
    grid.world_comm.barrier()
    tracer.reset_clock()
    lead = grid.rank == 0
    if lead and cfg.run.trace and trainer.step > 0:
        # a resumed run continues its predecessor's dump (rank 0 alone writes it)
        dump = cfg.out_dir / "trace.h5"
        if rewind_dump(dump, trainer.step, grid.world_comm.size):
            tracer.dumped.add(os.path.abspath(dump))
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        print(f"mpipar: {cfg.model.kind} with {trainer.model.n_params_full:,} parameters on "
              f"dp={p.dp} pp={p.pp} tp={p.tp} ({p.schedule}, {resolved.microbatches} "
              f"micro-batches), "
              f"{cfg.train.dtype} on {cfg.train.device}; run dir {out}", flush=True)
        for line in grid.placement():  # several nodes: the grid with hosts, a tp warning
            print(line, flush=True)
    file_attrs = {"config": cfg.to_dict(),
                  "peak_flops": _device_peak(grid, backend) if cfg.run.trace else float("nan")}

    def flush(complete=False):
        try:
            dump_trace(tracer, grid, out / "trace.h5", dict(file_attrs, complete=True)
                       if complete else file_attrs)
        except OSError as exc:  # rank 0 writes; the run directory was removed or became full
            raise OSError(f"could not write the timing dump {out / 'trace.h5'}: {exc}; check "
                          f"that the run directory exists and is writable") from exc

    history, val_loss, stopped = _steps(cfg, trainer, lead, flush,
                                        lambda: save_checkpoint(trainer, out / "checkpoints"))
    if stopped:
        _stop(cfg, trainer, lead, flush, stopped)
    if cfg.run.checkpoint_final or cfg.run.checkpoint_interval:
        save_checkpoint(trainer, out / "checkpoints")
    summary = _summary(cfg, trainer, history, val_loss)
    if cfg.run.trace:
        flush(complete=True)
    if lead:
        write_json_atomic(out / "metrics.json", summary)
        _print_summary(summary)
    return summary


class History:
    """What the summary needs of the steps, in O(8 bytes) a step: the losses (an array of
    doubles, for metrics.json) and the token and time sums of the steps after the first (the
    first holds the warm-up). The per-step records themselves go to the tracer's metrics, which
    each dump flush hands out and forgets, so a long run's memory stays flat."""

    def __init__(self):
        self.losses = array("d")
        self.tokens = self.seconds = 0.0
        self.first = None

    def append(self, rec: dict) -> None:
        self.losses.append(float(rec["loss"]))
        if len(self.losses) == 1:
            self.first = (rec["tokens"], rec["step_time"])
        else:
            self.tokens += rec["tokens"]
            self.seconds += rec["step_time"]

    def tokens_per_s(self) -> float:
        if not self.losses:
            return float("nan")
        tokens, seconds = (self.tokens, self.seconds) if len(self.losses) > 1 else self.first
        return tokens / max(seconds, 1e-9)


def _steps(cfg: Config, trainer: Trainer, lead: bool, flush, checkpoint):
    """The training steps left, with evaluation, progress, checkpoints and dump flushes.
    Returns (History of the steps, last validation loss, the stop signal or 0)."""
    from ..mpi import Watchdog

    history, val_loss = History(), float("nan")
    start = time.perf_counter()
    n = cfg.train.steps
    dog = Watchdog(cfg.run.watchdog_s, first_step=trainer.step).start()
    pending = 0  # a stop agreed while a continuous run is in flight waits for its drain
    try:
        with StopSignals() as signals:
            for i in range(trainer.step, n):
                begin_step(i)
                rec = trainer.train_step(until=drain_point(cfg, i))
                last = i + 1 == n
                val = float("nan")
                if cfg.train.eval_interval and ((i + 1) % cfg.train.eval_interval == 0 or last):
                    beat("evaluation")
                    val = val_loss = trainer.evaluate()
                rec["val_loss"] = val
                trainer.tracer.add_metrics(**rec)
                history.append(rec)
                if lead and cfg.run.progress:
                    _maybe_progress(cfg, i, n, rec, start)
                # every rank stops after the same step (the last one needs no agreement)
                pending = pending or (0 if last else signals.agree())
                if pending and trainer.drained:
                    return history, val_loss, pending
                _periodic(cfg, i + 1, last, flush, checkpoint)
    finally:
        dog.stop()
    return history, val_loss, 0


def drain_point(cfg: Config, i: int) -> int:
    """The first step >= i after which the pipeline must drain (continuous schedules): before
    an evaluation or a checkpoint, so that they see one weight version per stage, and at the
    end. A stop signal (preemption) is honoured at the next of these."""
    n, ev, ci = cfg.train.steps, cfg.train.eval_interval, cfg.run.checkpoint_interval
    ends = [n - 1] + [i + (-(i + 1)) % k for k in (ev, ci) if k]
    return min(ends)


def _maybe_progress(cfg, i, n, rec, start):
    every = cfg.run.log_interval if not sys.stdout.isatty() else 1
    if (i + 1) % max(every, 1) == 0 or i + 1 == n:
        _progress(i, n, rec, start, sys.stdout)
        if not math.isnan(rec["val_loss"]):
            print(f"  val loss {rec['val_loss']:.4f}", flush=True)


def _periodic(cfg, done, last, flush, checkpoint):
    """The checkpoint and the dump flush due after ``done`` steps."""
    ci = cfg.run.checkpoint_interval
    if ci and done % ci == 0 and not last:
        beat("a checkpoint write")
        checkpoint()
    if cfg.run.trace and cfg.run.flush_interval and done % cfg.run.flush_interval == 0:
        beat("a dump flush")
        flush()


def _stop(cfg, trainer, lead, flush, signum):
    """Preemption: every rank has finished the same step; checkpoint, flush, say so, raise."""
    from ..checkpoint import save_checkpoint

    path = save_checkpoint(trainer, cfg.out_dir / "checkpoints")
    if cfg.run.trace:
        flush()
    if lead:
        print(f"mpipar: signal {signum}: stopped after step {trainer.step}, checkpoint {path}; "
              f"resume with --resume auto (or latest)", flush=True)
    raise Preempted(trainer.step, signum)


def _progress(i, n, rec, start, stream):
    width = 24
    done = int(width * (i + 1) / n)
    tok_s = rec["tokens"] / max(rec["step_time"], 1e-9)
    line = (f"\r[{'#' * done}{'.' * (width - done)}] step {i + 1}/{n} loss {rec['loss']:.4f} "
            f"{tok_s:,.0f} tok/s {time.perf_counter() - start:.0f}s")
    stream.write(line if stream.isatty() else line[1:] + "\n")
    stream.flush()


def _device_peak(grid, backend) -> float:
    """The GEMM peak of one device (``mpipar.perf.device_peak``), measured on world rank 0."""
    if grid.rank != 0:
        return float("nan")
    from ..perf import device_peak

    return device_peak(backend, ranks_on_host=sum(1 for h in grid.hostnames
                                                  if h == grid.hostname))


def prepare_data(cfg: Config, grid):
    """The token file of a GPT run: ``data.path``, or the default corpus, prepared once by
    world rank 0 while the others wait."""
    from ..datasets import ensure_corpus

    path = cfg.data.path or None
    if grid.rank == 0 and path is None:
        ensure_corpus(None, max_bytes=cfg.data.max_bytes)
    grid.world_comm.barrier()
    if path is None:
        from ..datasets import default_corpus_path

        path = default_corpus_path()
    return path


def _summary(cfg, trainer, history: History, val_loss):
    s = {
        "final_loss": history.losses[-1] if history.losses else float("nan"),
        "losses": history.losses.tolist(),
        "val_loss": val_loss,
        "tokens_per_s": history.tokens_per_s(),
        "steps": trainer.step,
        "params": trainer.model.n_params_full,
        "grid": {"dp": cfg.parallel.dp, "pp": cfg.parallel.pp, "tp": cfg.parallel.tp},
        "schedule": cfg.parallel.schedule,
        "microbatches": trainer.run.microbatches,
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

