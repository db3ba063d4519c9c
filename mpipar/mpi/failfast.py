"""An exception on any rank ends the whole job within seconds, naming the rank (DESIGN contract 8).

Without this, a rank that raises exits (its atexit runs MPI_Finalize) while its peers stay
blocked forever in a receive or a collective that will never complete. ``install()`` hooks
``sys.excepthook``; ``guard()`` covers a ``with`` block (and a non-zero ``sys.exit`` inside it,
which the hook never sees). Both print ``[mpipar] rank R (host H) failed:`` and the traceback to
stderr, flush, and call ``MPI.COMM_WORLD.Abort(1)``, which makes mpiexec kill every rank.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

_installed = False
ABORT_GRACE_S = 0.3


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


def _report_and_abort(text: str, code: int = 1) -> None:
    """Print the failure, flush both streams, abort every rank. Does not return under MPI."""
    header = f"[mpipar] rank {_rank()} (host {socket.gethostname()}) failed:\n"
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(header + text)
        if not text.endswith("\n"):
            sys.stderr.write("\n")
        sys.stderr.flush()
    except Exception:
        pass
    # Give mpiexec's output forwarding a moment: Abort kills every process at once, and a
    # traceback still in the launcher's pipes would be lost (seen under load).
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


def _excepthook(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        text = "KeyboardInterrupt\n"
    else:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
    _report_and_abort(text, 1)


def _thread_hook(args) -> None:
    if args.exc_type is SystemExit:
        return
    text = f"in thread {args.thread.name if args.thread else '?'}:\n" + "".join(
        traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
    )
    _report_and_abort(text, 1)


def install() -> None:
    """Make an uncaught exception on this rank (main thread or any thread) abort the whole job."""
    global _installed
    if _installed:
        return
    sys.excepthook = _excepthook
    threading.excepthook = _thread_hook
    _installed = True


@contextmanager
def guard():
    """Abort the whole job if the block raises (or calls ``sys.exit`` with a non-zero status)."""
    try:
        yield
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            raise
        status = code if isinstance(code, int) else 1
        _report_and_abort(f"exited with status {code!r}\n", status)
    except BaseException as exc:
        _report_and_abort("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), 1)
