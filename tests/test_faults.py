"""Faults injected into the real training loop (tests/mpi/fault_inject.py) end the whole job
promptly, non-zero, said once by the failing rank, with the dump written so far readable; a
SIGUSR1 mid-run stops every rank at one step, and the resumed run ends bitwise where an
uninterrupted one does."""

import json
import os
import re
import shutil
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
    assert resumed["losses"] == whole["losses"]  # bitwise, float64, the predecessor's kept
    assert resumed["final_loss"] == whole["final_loss"]
    # the resumed run continued the dump: every step once, in order, and it still analyses
    from mpipar.analysis import load

    dump = load(cut / "trace.h5")  # the index and its parts (docs/dump_schema.md)
    assert list(dump.metrics["step"]) == list(range(150))
    assert dump.complete
    out = subprocess.run([sys.executable, "-m", "mpipar.cli", "analyze", str(cut / "trace.h5")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ----- after MPI started: one message per job, signals that never lose a checkpoint -----------

def _train(n, out, tokens, *extra, timeout=180, script=None):
    head = [sys.executable, *(script or ["-m", "mpipar.cli", "train"])]
    return run_mpi(n, [*head, *train_args(tokens, out, *extra)], timeout=timeout)


@pytest.fixture(scope="module")
def saved(tokens, tmp_path_factory):
    """A 1-block-per-stage run with checkpoints at steps 2 and 4 (float64)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    _train(1, out, tokens, "--steps", "4", "--dtype", "float64",
           "--set", "run.checkpoint_interval=2", "--set", "run.checkpoint_final=true")
    assert (out / "checkpoints/latest").read_text().strip() == "step_000004.h5"
    return out


def _flip(src, dst):
    """``src`` with one byte of the first tensor's data flipped (its checksum no longer holds)."""
    import h5py

    with h5py.File(src, "r") as f:
        ds = f["params"][sorted(f["params"])[0]]
        offset = ds.id.get_offset()
    raw = bytearray(Path(src).read_bytes())
    raw[offset + 3] ^= 0x40
    Path(dst).write_bytes(bytes(raw))


def _bad_input(case, saved, tokens, tmp):
    """(extra train args, words of the one message) of a failure every rank hits after MPI
    started."""
    good = saved / "checkpoints/step_000002.h5"
    bad = tmp / "bad.h5"
    if case == "ck-missing":
        return ["--resume", str(tmp / "nope.h5")], "nope.h5 does not exist"
    if case == "ck-truncated":
        bad.write_bytes(good.read_bytes()[:5000])
        return ["--resume", str(bad)], "cannot be read (truncated or corrupted?)"
    if case == "ck-flipped":
        _flip(good, bad)
        return ["--resume", str(bad)], "does not match its sha256 checksum"
    if case == "ck-empty":
        bad.write_bytes(b"")
        return ["--resume", str(bad)], "bad.h5 cannot be read"
    if case == "ck-shape":
        return ["--resume", str(good), "--set", "model.n_embd=32"], "the model needs"
    if case == "ck-steps":
        return ["--resume", str(good), "--steps", "1"], "at step 2 but train.steps = 1"
    if case == "ck-folder":
        return ["--resume", str(saved)], "is a folder: pass a checkpoint file"
    if case == "latest-empty":
        (tmp / "run/checkpoints").mkdir(parents=True)
        (tmp / "run/checkpoints/latest").write_text("")
        return ["--resume", "latest"], "latest is empty (an interrupted write?)"
    if case == "latest-deleted":
        (tmp / "run/checkpoints").mkdir(parents=True)
        (tmp / "run/checkpoints/latest").write_text("step_000002.h5\n")
        return ["--resume", "auto"], "names step_000002.h5, which does not exist (deleted?)"
    if case == "tok-folder":
        return ["--data", str(tmp)], "is a folder: pass the .h5 file"
    if case == "tok-missing":
        return ["--data", str(tmp / "none.h5")], "none.h5 does not exist"
    if case == "tok-corrupt":
        bad.write_bytes(os.urandom(4096))
        return ["--data", str(bad)], "is not a readable HDF5 file"
    assert case == "tok-vocab"
    return ["--set", "model.vocab_size=100"], "has vocabulary 256 but model.vocab_size = 100"


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["ck-missing", "ck-truncated", "ck-flipped", "ck-empty",
                                  "ck-shape", "ck-steps", "ck-folder", "latest-empty",
                                  "latest-deleted", "tok-folder", "tok-missing", "tok-corrupt",
                                  "tok-vocab"])
def test_an_error_every_rank_hits_after_start_is_said_once(case, saved, tokens, tmp_path):
    extra, words = _bad_input(case, saved, tokens, tmp_path)
    res = _train(2, tmp_path / "run", tokens, "--pp", "2", "--steps", "4", "--dtype", "float64",
                 *extra)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("mpipar train: error: ") == 1, res.stderr[-3000:]
    assert words in res.stderr and "[mpipar] rank" not in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.mark.mpi
def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(saved, tokens, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved / "checkpoints", out / "checkpoints")
    _flip(saved / "checkpoints/step_000004.h5", out / "checkpoints/step_000004.h5")
    res = _train(1, out, tokens, "--steps", "5", "--dtype", "float64", "--resume", "auto")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("step_000004.h5: tensor") == 1, res.stderr
    assert "resuming from the newest intact checkpoint instead" in res.stderr
    assert f"resumed from {out / 'checkpoints/step_000002.h5'} at step 2" in res.stdout


@pytest.mark.mpi
def test_resuming_a_finished_run_trains_nothing_and_says_so(saved, tokens, tmp_path):
    res = _train(1, tmp_path / "run", tokens, "--steps", "4", "--dtype", "float64",
                 "--resume", str(saved / "checkpoints/step_000004.h5"))
    assert res.returncode == 0 and "nothing left to train" in res.stdout, res.stderr[-3000:]
    assert not (tmp_path / "run/metrics.json").exists()


@pytest.mark.mpi
def test_usr1_during_the_start_checkpoints_then_resumes_exactly(tokens, tmp_path):
    """MPICH's MPI_Init installs its own SIGUSR1 handler: ours must come after it, so a Slurm
    warning arriving during a slow start still ends in a checkpoint, exit 75 and an exact
    resume (with the whole loss curve in metrics.json)."""
    grid = ["--pp", "2", "--steps", "6", "--dtype", "float64", "--resume", "auto"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _train(2, full, tokens, *grid).returncode == 0
    res = _train(2, cut, tokens, *grid, script=[str(MPI_DIR / "fault_inject.py"), "usr1_start",
                                                "1", "-1"])
    assert res.returncode == 75, res.stderr[-3000:]
    assert "stopped after step 1" in res.stdout and "[mpipar] rank" not in res.stderr
    assert (cut / "checkpoints/latest").read_text().strip() == "step_000001.h5"
    res = _train(2, cut, tokens, *grid)
    assert res.returncode == 0 and "at step 1" in res.stdout, res.stderr[-3000:]
    resumed, whole = _losses(cut), _losses(full)
    assert resumed["losses"] == whole["losses"] and len(whole["losses"]) == 6  # bitwise


@pytest.mark.mpi
def test_a_second_term_during_the_preemption_checkpoint_is_ignored(tokens, tmp_path):
    out = tmp_path / "run"
    res = _train(2, out, tokens, "--pp", "2", "--steps", "100000",
                 script=[str(MPI_DIR / "fault_inject.py"), "term_twice", "1", "3"])
    assert res.returncode == 75, res.stderr[-3000:]
    assert res.stderr.count("fault_inject: second SIGTERM") == 2, res.stderr[-3000:]
    assert res.stderr.count("signal 15 again: ignored") == 1, res.stderr[-3000:]
    assert "stopped after step 4" in res.stdout and "[mpipar] rank" not in res.stderr
    assert (out / "checkpoints/latest").read_text().strip() == "step_000004.h5"


@pytest.mark.mpi
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file(tokens, tmp_path):
    """rank 0 can write nothing over 4 KiB from step 3 (as on a full disk): its checkpoint of
    step 4 fails: exit 2 (handled, not a bug), one line naming the file, no half-written file,
    `latest` still names step 2."""
    out = tmp_path / "run"
    res = _train(2, out, tokens, "--pp", "2", "--steps", "8", "--no-trace",
                 "--set", "run.checkpoint_interval=2",
                 script=[str(MPI_DIR / "fault_inject.py"), "fsize", "0", "3"])
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("[mpipar] rank ")]
    assert res.returncode == 2 and len(ours) == 1, res.stderr[-3000:]
    assert f"could not write {out / 'checkpoints/step_000004.h5'}" in ours[0], ours
    assert "Traceback" not in res.stderr
    assert (out / "checkpoints/latest").read_text().strip() == "step_000002.h5"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest",
                                                                        "step_000002.h5"]


@pytest.mark.mpi
def test_ctrl_c_to_every_rank_says_interrupted_once(tokens, tmp_path):
    res = _train(2, tmp_path / "run", tokens, "--pp", "2", "--steps", "100000",
                 script=[str(MPI_DIR / "fault_inject.py"), "sigint", "-1", "3"])
    assert res.returncode == 130, res.stderr[-3000:]
    assert res.stderr.count("interrupted (SIGINT)") == 1, res.stderr[-3000:]


@pytest.mark.mpi
def test_an_unknown_flag_under_mpiexec_prints_the_train_usage_once(tmp_path):
    res = run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train", "--stepz", "3"], timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("usage: mpipar train") == 1, res.stderr
    assert res.stderr.count("mpipar train: error: unrecognized arguments: --stepz 3") == 1


@pytest.mark.mpi
def test_the_watchdog_names_the_stopped_rank_it_waits_for(tokens, tmp_path):
    res = _train(2, tmp_path / "run", tokens, "--pp", "2", "--steps", "100000",
                 "--set", "run.watchdog_s=3",
                 script=[str(MPI_DIR / "fault_inject.py"), "sigstop", "1", "3"])
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("[mpipar] rank ")]
    assert res.returncode == 124 and len(ours) == 1, res.stderr[-3000:]
    assert ours[0].startswith("[mpipar] rank 0 ") and "waiting for rank 1 (host" in ours[0], ours
