"""Any failure on any rank ends the whole job within seconds, said once by the rank that failed
(docs/architecture.md, "One fault path", which also lists the exit codes).

Without it, a rank that raises exits (its atexit runs MPI_Finalize) while its peers stay blocked
forever in a receive or a collective that will never complete; a rank that calls ``sys.exit``
hangs the same way. Two phases:

- ``agree_on_start(error)``: the deterministic start (config, preflight) runs on every rank
  before any MPI traffic, so every rank can still reach one collective. The ranks exchange who
  failed; the lowest failing rank prints its message and every rank returns ``EXIT_INPUT`` (a
  clean exit, no abort, one message instead of one per rank).
- ``guard()`` (and ``install()`` for plain scripts and threads) after that: the failing rank
  prints ``[mpipar] rank R (host H) failed: <one line>`` (plus the traceback for an unexpected
  exception) in one write, and calls ``MPI_Abort``, which makes the launcher kill every rank.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

# exit codes of `mpipar train` (documented in docs/architecture.md, slurm/README.md)
EXIT_ERROR = 1  # an unexpected exception (a bug): the traceback is printed
EXIT_INPUT = 2  # a handled error: bad config, missing or corrupt data / checkpoint, unwritable
EXIT_INTERRUPT = 130  # Ctrl-C (SIGINT) on a rank
EXIT_STALLED = 124  # the watchdog: no progress for run.watchdog_s (like timeout(1))
EXIT_PREEMPTED = 75  # SIGTERM / SIGUSR1: checkpoint written, resume later (EX_TEMPFAIL)

ABORT_GRACE_S = 0.3
# A rank whose MPI call fails because a peer died is not the culprit: it waits this long before
# reporting, so the culprit's own message (and the launcher's kill) come first.
SECONDARY_DELAY_S = 3.0

_installed = False
_brief: tuple = ()  # exception types reported in one line, without a traceback
_failing = threading.Lock()


def _rank() -> str:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                return str(mpi.COMM_WORLD.Get_rank())
        except Exception:
            pass
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var]
    return "?"


def _write_stderr(text: str) -> None:
    """One write of the whole text: lines of ranks failing together do not interleave."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.flush()
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(2, data):]
    except Exception:
        pass


def fail(line: str, details: str = "", code: int = EXIT_ERROR) -> None:
    """Print ``line`` (one line) and ``details`` as this rank's failure, abort every rank.

    Does not return. A second failure on this rank (another thread) waits for the first."""
    if not _failing.acquire(blocking=False):
        while True:  # the first failure is aborting the job
            time.sleep(1)
    line = " ".join(line.split())  # one line, whatever the message held
    header = f"[mpipar] rank {_rank()} (host {socket.gethostname()}) failed: {line}\n"
    _write_stderr(header + details + ("" if not details or details.endswith("\n") else "\n"))
    # Give the launcher's output forwarding a moment: Abort kills every process at once, and a
    # message still in its pipes would be lost (seen under load).
    time.sleep(ABORT_GRACE_S)
    _abort(code)


def _abort(code: int) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.COMM_WORLD.Abort(code)
        except Exception:
            pass
    os._exit(code)  # no MPI (or Abort failed): still never hang in atexit handlers


def _is_secondary(exc: BaseException) -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(exc, mpi.Exception)


def fail_with(exc: BaseException) -> None:
    """Report ``exc`` (raised on this rank) and abort the job. Does not return."""
    if isinstance(exc, SystemExit):
        code = exc.code
        fail(f"exited with status {code!r}", code=code if isinstance(code, int) else EXIT_ERROR)
    if isinstance(exc, KeyboardInterrupt):
        if _rank() not in ("0", "?"):  # Ctrl-C reaches every rank of the process group: rank 0
            time.sleep(SECONDARY_DELAY_S)  # says it, its abort ends the others before they do
        fail("interrupted (SIGINT)", code=EXIT_INTERRUPT)
    if _brief and isinstance(exc, _brief):
        fail(str(exc) or type(exc).__name__, code=EXIT_INPUT)
    if _is_secondary(exc):
        time.sleep(SECONDARY_DELAY_S)
    first = traceback.format_exception_only(type(exc), exc)[-1].strip()
    fail(first, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _excepthook(exc_type, exc, tb) -> None:
    fail_with(exc)


def _thread_hook(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread else "?"
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                              args.exc_traceback))
    fail(f"in thread {name}: {traceback.format_exception_only(args.exc_type, args.exc_value)[-1]}",
         text)


def install(brief: tuple = ()) -> None:
    """Make an uncaught exception on this rank (main thread or any thread) abort the whole job.
    ``brief``: exception types whose message alone is printed (exit ``EXIT_INPUT``)."""
    global _installed, _brief
    _brief = tuple(brief) or _brief
    if _installed:
        return
    sys.excepthook = _excepthook
    threading.excepthook = _thread_hook
    _installed = True


@contextmanager
def guard(brief: tuple = ()):
    """Abort the whole job if the block raises (or calls ``sys.exit`` with a non-zero status)."""
    install(brief)
    try:
        yield
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            raise
        fail_with(exc)
    except BaseException as exc:
        fail_with(exc)


def agree_on_start(error: BaseException | None, prefix: str = "error: ") -> int:
    """Collective over the world: 0 when no rank failed its start, else the same non-zero code
    on every rank (``EXIT_INPUT`` for the ``brief`` types of ``install``, ``EXIT_ERROR`` with
    the traceback for others), the lowest failing rank having printed ``prefix`` + its message
    (naming itself when not every rank failed). Call it on every rank before any other MPI
    traffic, with this rank's error or None."""
    from mpi4py import MPI

    code = 0
    if error is not None:
        code = EXIT_INPUT if _brief and isinstance(error, _brief) else EXIT_ERROR
    import numpy as np

    comm = MPI.COMM_WORLD
    codes = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([code], dtype=np.int64), codes)  # a buffer call: no pickling
    codes = codes.tolist()
    if not any(codes):
        return 0
    first = next(r for r, c in enumerate(codes) if c)
    if comm.Get_rank() == first:
        who = "" if all(codes) else f"rank {first} (host {socket.gethostname()}): "
        line = " ".join(str(error).split()) or type(error).__name__
        if code == EXIT_ERROR:
            line = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        elif who and isinstance(error, FileNotFoundError):
            # some rank opened it: a path private to some nodes, not a file to make again
            line = (f"{line.split('; ')[0]} on this host, but other ranks found it: put it on a"
                    " filesystem every node sees (or copy it to the same path here)")
        _write_stderr(f"{prefix}{who}{line}\n")
    return max(codes)


def world_max(value: int) -> int:
    """The largest ``value`` over every rank of the world (one 8-byte all-reduce, not traced:
    the per-step stop agreement of ``mpipar.training.signals``)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return int(value)
    buf = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, MPI.MAX)
    return int(buf[0])
