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

from .. import progress
from ..backend import Backend
from ..config import Config
from ..files import write_json_atomic
from ..models.balance import describe
from ..progress import beat, begin_step
from ..trace import Tracer, rewind_dump
from .preflight import preflight
from .signals import StopSignals
from .trainer import Trainer


class StartFailed(Exception):
    """Every rank ran the same set-up step after MPI started (the checkpoint to resume, the
    token file) and at least one failed: the lowest failing rank has said why, once, and every
    rank raises this with the same exit ``code`` (``failfast.agree_on_start``)."""

    def __init__(self, code: int):
        super().__init__(f"the run did not start (exit {code}): see the message above")
        self.code = code


class Preempted(Exception):
    """Every rank stopped at the same step on SIGTERM / SIGUSR1, after a checkpoint and a dump
    flush. ``mpipar train`` exits with ``failfast.EXIT_PREEMPTED``."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped at step {step} on signal {signum}")
        self.step, self.signum = step, signum


def check_run_settings(cfg: Config) -> None:
    """Resolve ``run.resume = "auto"``: kept when the run directory has a checkpoint (which
    one is ``checkpoint.find_resume``'s choice), else a start from scratch. Before any work.
    (Every field's range, run.watchdog_s's included, is config.RULES'.)"""
    if cfg.run.resume == "auto":
        ck = cfg.out_dir / "checkpoints"
        found = (ck / "latest").is_file() or any(ck.glob("step_*.h5"))
        cfg.run.resume = "auto" if found else ""


def agreed(step, *args):
    """``step(*args)`` on every rank, then the ranks agree as at the start: when any failed,
    the lowest failing rank says why in one line (not one line per rank) and every rank raises
    ``StartFailed``. ``step`` must do no MPI traffic (a rank that failed takes no part in it)."""
    from ..mpi import failfast

    error = result = None
    try:
        result = step(*args)
    except Exception as exc:
        error = exc
    code = failfast.agree_on_start(error, prefix="mpipar train: error: ")
    if code:
        raise StartFailed(code)
    return result


def run(cfg: Config, resolved=None) -> dict:
    """Train as the config says, on whatever MPI world this process belongs to.
    ``resolved``: the run ``preflight`` resolved (``mpipar train`` runs preflight before this).
    The stop signals are handled from here (or from ``mpipar train``'s start, right after
    ``MPI_Init``) until the preemption checkpoint and dump are on disk."""
    with StopSignals() as signals:
        return _run(cfg, resolved, signals)


def _build(cfg: Config, resolved):
    """This rank's trainer on the grid, resumed as run.resume says: (trainer, resolved run)."""
    from ..checkpoint import find_resume, maybe_resume
    from ..mpi import ProcessGrid, bind_gpu, failfast, world_size_and_rank
    from .batches import open_tokens

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
    data = None
    if cfg.model.kind == "gpt":  # read and checked on every rank; one message if it fails
        data = agreed(open_tokens, cfg, prepare_data(cfg, grid))
    trainer = Trainer(cfg, grid, tracer, backend, data, resolved=resolved)
    maybe_resume(trainer, agreed(find_resume, trainer))
    grid.world_comm.barrier()
    return trainer, resolved


def _flusher(tracer, grid, out, file_attrs):
    """``flush(complete=False)``: this rank's new events into its part of ``out/trace.h5``."""
    from ..mpi import dump_trace, failfast, prepare_dump

    prepare_dump()

    def flush(complete=False):
        try:
            dump_trace(tracer, grid, out / "trace.h5", dict(file_attrs, complete=True)
                       if complete else file_attrs)
        except OSError as exc:  # its own part: the run directory was removed or became full
            if grid.world_comm.rank != 0 and not out.is_dir():
                # every rank writes its part, so a vanished run directory fails them all: rank
                # 0 says it once and its abort ends the others before they do
                time.sleep(failfast.SECONDARY_DELAY_S)
            raise OSError(f"could not write the timing dump {out / 'trace.h5'}: {exc}; check "
                          f"that the run directory exists and is writable") from exc

    return flush


def _run(cfg: Config, resolved, signals) -> dict:
    from ..checkpoint import save_checkpoint

    trainer, resolved = _build(cfg, resolved)
    grid, tracer, backend, p, out = (trainer.grid, trainer.tracer, trainer.backend,
                                     cfg.parallel, cfg.out_dir)
    if trainer.step == cfg.train.steps and trainer.step > 0:
        if grid.rank == 0:
            print(f"mpipar: the checkpoint is at step {trainer.step} = train.steps: nothing "
                  f"left to train (pass a larger --steps to train on)", flush=True)
        return {"steps": trainer.step}
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
              f"dp={p.dp} pp={p.pp} tp={p.tp} ({p.schedule_file or p.schedule}, "
              f"{resolved.microbatches} micro-batches), "
              f"{cfg.train.dtype} on {cfg.train.device}; run dir {out}", flush=True)
        if p.layout == "auto":
            print(f"mpipar: layout auto: {describe(cfg.model, resolved.bounds)}", flush=True)
        for line in grid.placement():  # several nodes: the grid with hosts, a tp warning
            print(line, flush=True)
    # a resumed run's metrics.json continues its predecessor's loss curve
    prior = _prior_losses(out / "metrics.json", trainer.step) if lead and trainer.step else None
    file_attrs = {"config": cfg.to_dict(), "layout": describe(cfg.model, resolved.bounds),
                  "peak_flops": _device_peak(grid, backend) if cfg.run.trace else float("nan")}

    flush = _flusher(tracer, grid, out, file_attrs)

    history, val_loss, stopped = _steps(cfg, trainer, lead, flush,
                                        lambda: save_checkpoint(trainer, out / "checkpoints"),
                                        signals)
    if stopped:  # the curve so far, kept for the resumed run
        if lead:
            write_json_atomic(out / "metrics.json",
                              dict(_summary(cfg, trainer, history, val_loss, prior),
                                   preempted=True))
        _stop(cfg, trainer, lead, flush, stopped)
    if cfg.run.checkpoint_final or cfg.run.checkpoint_interval:
        save_checkpoint(trainer, out / "checkpoints")
    summary = _summary(cfg, trainer, history, val_loss, prior)
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


def _steps(cfg: Config, trainer: Trainer, lead: bool, flush, checkpoint, signals):
    """The training steps left, with evaluation, progress, checkpoints and dump flushes.
    Returns (History of the steps, last validation loss, the stop signal or 0)."""
    from ..mpi import Watchdog

    history, val_loss = History(), float("nan")
    start = time.perf_counter()
    n = cfg.train.steps
    progress.state.peer_of = _peer_of(trainer)
    dog = Watchdog(cfg.run.watchdog_s, first_step=trainer.step).start()
    pending = 0  # a stop agreed while a continuous run is in flight waits for its drain
    trainer.stop_signals = signals
    try:
        for i in range(trainer.step, n):
            begin_step(i)
            rec = trainer.train_step(until=drain_point(cfg, i))
            last = i + 1 == n
            val = float("nan")
            if cfg.train.eval_interval and ((i + 1) % cfg.train.eval_interval == 0 or last):
                beat("evaluation")
                val = val_loss = trainer.evaluate()
            rec["val_loss"] = val
            for r in trainer.settle(rec):  # continuous runs: the steps read metrics_lag late
                stop = r.pop("stop", 0)
                trainer.tracer.add_metrics(**r)
                history.append(r)
                if lead and cfg.run.progress:
                    _maybe_progress(cfg, r["step"], n, r, start, trainer.metrics_lag)
                pending = pending or (0 if last else stop)
            # every rank stops after the same step (the last one needs no agreement); a
            # lagged run agrees in its lagged reduction (``lagged``), with no meeting here
            if not trainer.metrics_lag and not last and not pending:
                agreed = trainer.take_stop()  # carried by the step's norm-and-loss reduction
                pending = agreed if agreed is not None else signals.agree()
            if pending and trainer.drained:
                return history, val_loss, pending
            _periodic(cfg, i + 1, last, flush, checkpoint)
    finally:
        dog.stop()
    return history, val_loss, 0


# the neighbouring chunk a pipeline action needs data from (or sends to): -1 before, +1 after
_PEER_STEP = {"F": -1, "RECV_F": -1, "SEND_B": -1, "B": +1, "BW": +1, "RECV_B": +1, "SEND_F": +1}


def _peer_of(trainer):
    """For the watchdog: the world rank (and host) a pipeline action waits for, or None."""
    g, run, n = trainer.grid, trainer.run, trainer.schedule.n_chunks

    def peer_of(what):
        other = getattr(what, "chunk", -1) + _PEER_STEP.get(getattr(what, "op", ""), n)
        if not 0 <= other < n or run.rank_of(other) == g.pp_rank:
            return None
        r = g.world_rank_of(g.dp_rank, run.rank_of(other), g.tp_rank)
        host = g.hostnames[r] if len(getattr(g, "hostnames", ())) > r else "?"
        return f"rank {r} (host {host}, pipeline stage of chunk {other})"

    return peer_of


def drain_point(cfg: Config, i: int) -> int:
    """The first step >= i after which the pipeline must drain (continuous schedules): before
    an evaluation or a checkpoint, so that they see one weight version per stage, and at the
    end. A stop signal (preemption) is honoured at the next of these."""
    n, ev, ci = cfg.train.steps, cfg.train.eval_interval, cfg.run.checkpoint_interval
    ends = [n - 1] + [i + (-(i + 1)) % k for k in (ev, ci) if k]
    return min(ends)


def _maybe_progress(cfg, i, n, rec, start, lag=0):
    every = cfg.run.log_interval if not sys.stdout.isatty() else 1
    if (i + 1) % max(every, 1) == 0 or i + 1 == n:
        _progress(i, n, rec, start, sys.stdout, lag)
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


def _progress(i, n, rec, start, stream, lag=0):
    width = 24
    done = int(width * (i + 1) / n)
    tok_s = rec["tokens"] / max(rec["step_time"], 1e-9)
    late = f" (read up to {lag} steps late)" if lag else ""
    line = (f"\r[{'#' * done}{'.' * (width - done)}] step {i + 1}/{n} loss {rec['loss']:.4f} "
            f"{tok_s:,.0f} tok/s {time.perf_counter() - start:.0f}s{late}")
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


def _prior_losses(path, step: int):
    """(first step, losses of the steps before ``step``) of the predecessor's metrics.json (a
    preempted or finished run in the same directory), or None when there is none to continue."""
    import json

    try:
        d = json.loads(path.read_text())
        losses = list(d["losses"])
        first = int(d.get("first_step", int(d["steps"]) - len(losses)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 <= first <= step or first + len(losses) < step:
        return None  # not the curve that led to this checkpoint
    return first, losses[:step - first]


def _summary(cfg, trainer, history: History, val_loss, prior=None):
    first, before = prior or (trainer.step - len(history.losses), [])
    s = {
        "final_loss": history.losses[-1] if history.losses else float("nan"),
        "losses": before + history.losses.tolist(),
        "first_step": first,
        "val_loss": val_loss,
        "tokens_per_s": history.tokens_per_s(),
        "steps": trainer.step,
        "params": trainer.model.n_params_full,
        "grid": {"dp": cfg.parallel.dp, "pp": cfg.parallel.pp, "tp": cfg.parallel.tp},
        "schedule": cfg.parallel.schedule,
        "microbatches": trainer.run.microbatches,
    }
    if trainer.metrics_lag:  # continuous runs: each step's loss read this many steps later
        s["metrics_lag_steps"] = trainer.metrics_lag
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

