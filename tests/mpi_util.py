"""Launch multi-rank test scripts under mpiexec, with a timeout that kills the whole job.

A hang (the failure mode of MPI code) becomes a test failure showing the job's last output,
never a stalled CI. Each rank gets one BLAS/OpenMP thread: the machine has few cores and the
tests oversubscribe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MPI_DIR = Path(__file__).resolve().parent / "mpi"
REPO = Path(__file__).resolve().parent.parent

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def run_mpi(n, args, timeout=120, env=None, cwd=None, check=False) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n N <args>``; return the finished process (text stdout/stderr).

    On timeout the process group is killed and the test fails with the output's tail.
    ``check=True`` also fails the test on a non-zero exit status.
    """
    full_env = {**os.environ, **ONE_THREAD, **(env or {})}
    # the scripts import mpipar and tests helpers from the checkout
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p
    )
    cmd = ["mpiexec", "-n", str(n), *[str(a) for a in args]]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # its own process group, so a timeout can kill every rank
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} timed out after {timeout} s (a hang?)\n"
            f"--- stdout tail ---\n{_tail(out)}\n--- stderr tail ---\n{_tail(err)}"
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited with status {result.returncode}\n"
            f"--- stdout tail ---\n{_tail(out)}\n--- stderr tail ---\n{_tail(err)}"
        )
    return result


def python_script(n, path, *args, timeout=120, env=None, cwd=None, check=False):
    """``mpiexec -n N python path args...``; a bare name is looked up in tests/mpi/."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = MPI_DIR / path
    return run_mpi(
        n, [sys.executable, str(path), *args], timeout=timeout, env=env, cwd=cwd, check=check
    )


# the 4-block GPT of the training tests (mpipar train flags)
SMALL_GPT = ["--set", "model.n_layer=4", "--set", "model.n_embd=16", "--set", "model.n_head=4",
             "--set", "model.block_size=16", "--seq-len", "16", "--batch-size", "8",
             "--set", "train.eval_interval=0", "--quiet"]


def assert_snippet_ok(code: str, env=None, timeout=60) -> None:
    """Run ``code`` in a fresh Python (one process, no mpiexec: a stand-in communicator) with the
    collectives choice reset to the built-in defaults, and check it printed ``ok``. A subprocess,
    because building a ``Comm`` loads mpi4py, which the test process should not initialise."""
    full = {**os.environ, "MPIPAR_COLLECTIVES": "auto",
            "MPIPAR_COLLECTIVES_TABLE": "/nonexistent", **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=full)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def run_experiment(script: str, out, *args, timeout=240) -> subprocess.CompletedProcess:
    """``python experiments/SCRIPT --quick --out OUT ARGS`` with one BLAS thread per rank (the
    script starts its own mpiexec jobs); fails the test with its output if it fails."""
    res = subprocess.run([sys.executable, str(REPO / "experiments" / script), "--quick",
                          "--out", str(out), *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, **ONE_THREAD}, timeout=timeout)
    assert res.returncode == 0, f"{_tail(res.stdout, 2000)}\n{_tail(res.stderr, 3000)}"
    return res
