"""Faults injected into the real training loop (tests/mpi/fault_inject.py) end the whole job
promptly, non-zero, said once by the failing rank, with the dump written so far readable; a
SIGUSR1 mid-run stops every rank at one step, and the resumed run ends bitwise where an
uninterrupted one does."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_util import MPI_DIR, ONE_THREAD, REPO, SMALL_GPT, run_mpi

# a job must end within 10 s of the fault on a quiet machine; the margin is for a loaded one
MAX_SECONDS = 30
TINY = SMALL_GPT


def train_args(tokens, out, *extra):
    return ["--data", tokens, "--out", str(out), *TINY, *extra]


# case: (faulty rank, exit code or None for "any non-zero", words of the one message or None)
CASES = {
    "ConfigError": (3, 2, "injected ConfigError on rank 3"),
    "DataError": (3, 2, "injected DataError on rank 3"),
    "CheckpointError": (3, 2, "injected CheckpointError on rank 3"),
    "FileNotFoundError": (3, 2, "injected FileNotFoundError on rank 3"),
    "exit3": (3, 3, "exited with status 3"),
    "python": (1, 1, "RuntimeError: injected python on rank 1"),
    "sigkill": (3, None, None),  # no word from the dead rank: the launcher ends the job
    "rundir": (3, 2, "could not write the timing dump"),  # rank 0's next flush fails
    "stall": (2, 124, "no progress for"),  # the watchdog (run.watchdog_s = 3)
}


def _run_case(case, tokens, out):
    rank, _, _ = CASES[case]
    args = ["--pp", "2", "--dp", "2", "--microbatches", "2", "--steps", "100000",
            "--set", "run.flush_interval=2", "--set", "run.watchdog_s=3"]
    res = run_mpi(4, [sys.executable, MPI_DIR / "fault_inject.py", case, rank, 5,
                      *train_args(tokens, out, *args)], timeout=180)
    ended = time.time()
    m = re.search(r"fault_inject: \S+ rank \d+ step 5 at ([0-9.]+)", res.stderr)
    assert m, res.stderr[-3000:]
    return res, ended - float(m.group(1))


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_fault_on_one_rank_ends_the_job(case, tokens, tmp_path):
    out = tmp_path / "run"
    rank, code, words = CASES[case]
    res, seconds = _run_case(case, tokens, out)
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("[mpipar] rank ")]
    launcher = [ln for ln in (res.stdout + res.stderr).splitlines() if "EXIT STRING" in ln]
    first = (ours or launcher or ["(nothing)"])[0]
    print(f"\nFAULT | {case} | exit {res.returncode} | {seconds:.1f} s | {first}")
    assert res.returncode != 0 and (code is None or res.returncode == code), res.stderr[-3000:]
    assert seconds < MAX_SECONDS, f"the job took {seconds:.1f} s to end after the fault"
    if words is None:
        assert not ours, res.stderr
    else:  # said once, by the failing rank, at most one traceback
        assert len(ours) == 1 and words in ours[0], res.stderr[-3000:]
        assert f"rank {0 if case == 'rundir' else rank} " in ours[0]
        assert res.stderr.count("Traceback (most recent call last)") <= 1
    dump = (Path(str(out) + ".moved") if case == "rundir" else out) / "trace.h5"
    ana = subprocess.run([sys.executable, "-m", "mpipar.cli", "analyze", str(dump)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    assert ana.returncode == 0, ana.stderr[-3000:]


@pytest.mark.mpi
def test_signal_on_one_rank_stops_every_rank_at_one_step(tokens, tmp_path):
    out = tmp_path / "run"
    res = run_mpi(4, [sys.executable, MPI_DIR / "fault_inject.py", "usr1", 2, 5,
                      *train_args(tokens, out, "--pp", "2", "--dp", "2", "--microbatches", "2",
                                  "--steps", "100000")], timeout=180)
    assert res.returncode == 75, res.stderr[-3000:]
    assert "stopped after step 6" in res.stdout and "[mpipar] rank" not in res.stderr
    assert (out / "checkpoints/latest").read_text().strip() == "step_000006.h5"


def _losses(out):
    return json.loads((Path(out) / "metrics.json").read_text())


@pytest.mark.mpi
def test_sigusr1_mid_run_then_resume_auto_is_exact(tokens, tmp_path):
    """Preemption as Slurm does it (--signal=USR1@90 reaches the launcher, which forwards it):
    rc 75 with a checkpoint, then --resume auto ends with the same float64 loss, bitwise."""
    grid = ["--pp", "2", "--microbatches", "2", "--steps", "150", "--dtype", "float64",
            "--set", "run.flush_interval=2", "--resume", "auto"]
    full = tmp_path / "full"
    run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train", *train_args(tokens, full, *grid)],
            timeout=300, check=True)
    cut = tmp_path / "cut"
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpipar.cli", "train",
           *train_args(tokens, cut, *grid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (cut / "trace.h5").exists():  # the first flush: step 2 is done
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no dump flush appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 75, stderr[-3000:]
    stopped = int(re.search(r"stopped after step (\d+)", stdout).group(1))
    assert 2 <= stopped < 150
    res = run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train",
                      *train_args(tokens, cut, *grid)], timeout=300, check=True)
    assert f"resumed from {cut / 'checkpoints' / f'step_{stopped:06d}.h5'}" in res.stdout
    resumed, whole = _losses(cut), _losses(full)
    assert resumed["steps"] == whole["steps"] == 150
    assert resumed["losses"] == whole["losses"][stopped:]  # bitwise, float64
    assert resumed["final_loss"] == whole["final_loss"]
    # the resumed run continued the dump: every step once, in order, and it still analyses
    from mpipar.analysis import load

    dump = load(cut / "trace.h5")  # the index and its parts (docs/dump_schema.md)
    assert list(dump.metrics["step"]) == list(range(150))
    assert dump.complete
    out = subprocess.run([sys.executable, "-m", "mpipar.cli", "analyze", str(cut / "trace.h5")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
