"""Slurm support: render arithmetic and errors (no cluster), then real jobs on a local cluster.

The cluster tests bring up munged + slurmctld + slurmd on localhost once per session
(tests/slurm_cluster.py) and are skipped, with the reason, where that cannot be done (not root,
no apt). Jobs run the real `mpipar train` on the tiny config with few steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_util import run_mpi  # noqa: E402
from slurm_cluster import ClusterUnavailable, SlurmCluster  # noqa: E402

from mpipar import slurm  # noqa: E402
from mpipar.cli import main as cli_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "experiments" / "configs" / "tiny.toml"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
JOB_TIMEOUT = 240  # seconds; a stuck job fails the test (and is cancelled at tear-down)


# ---- render: node / task arithmetic and its errors (no cluster) ------------------------------

@pytest.mark.parametrize("ntasks, gpus, per_node, nodes, expected", [
    (4, None, None, None, (4, None, None)),   # CPU, Slurm places the tasks
    (8, None, 4, None, (8, 2, 4)),            # 8 ranks at 4 per node: 2 nodes
    (6, None, 4, None, (6, 2, 4)),            # partial last node
    (8, 4, None, None, (8, 2, 4)),            # one rank per GPU
    (8, 4, 4, None, (8, 2, 4)),
    (3, 8, None, None, (3, 1, 8)),
    (8, None, 4, 3, (8, 3, 4)),               # more nodes than needed is allowed
])
def test_allocation_arithmetic(ntasks, gpus, per_node, nodes, expected):
    a = slurm.allocation(ntasks, gpus_per_node=gpus, tasks_per_node=per_node, nodes=nodes)
    assert (a.ntasks, a.nodes, a.tasks_per_node) == expected


def test_allocation_too_many_tasks_says_what_to_change():
    with pytest.raises(slurm.SlurmError, match=r"needs 8 ranks.*gives only 4 tasks.*--nodes 2"):
        slurm.allocation(8, tasks_per_node=4, nodes=1)
    with pytest.raises(slurm.SlurmError, match=r"needs 16 ranks.*4 GPUs per node.*--nodes 4"):
        slurm.allocation(16, gpus_per_node=4, nodes=2)
    with pytest.raises(slurm.SlurmError, match="one rank per GPU"):
        slurm.allocation(8, gpus_per_node=4, tasks_per_node=8)
    with pytest.raises(slurm.SlurmError, match="positive integer"):
        slurm.allocation(0)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main(["slurm", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_render_gpu_script(capsys):
    rc, out, _ = _cli(capsys, "render", "--config", "c.toml", "--dp", 2, "--pp", 2, "--tp", 2,
                      "--gpus-per-node", 4, "--partition", "gpu", "--time", "01:00:00",
                      "--schedule", "1f1b", "--microbatches", 8, "--steps", 5)
    assert rc == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=8", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --gpus-per-task=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "DP=2", "PP=2", "TP=2", "SCHEDULE=1f1b",
                 "MICROBATCHES=8", "STEPS=5", "DEVICE=cuda", "CONFIG=c.toml"):
        assert line in out.splitlines(), line
    assert "--mpi=" in out and "OMP_NUM_THREADS=$CPUS" in out
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)  # valid bash


def test_render_too_many_tasks_is_a_clear_cli_error(capsys):
    rc, out, err = _cli(capsys, "render", "--config", "c.toml", "--dp", 4, "--tp", 2,
                        "--tasks-per-node", 2, "--nodes", 2)
    assert rc == 2 and out == ""
    assert "needs 8 ranks" in err and "--nodes 4" in err


def test_render_sweep_is_one_array_sized_for_the_largest_grid(tmp_path, capsys):
    sweep = tmp_path / "grids.txt"
    sweep.write_text("# grid sweep\ndp=1\ndp=2 pp=2 schedule=gpipe  # four ranks\n\n"
                     "tp=2 microbatches=4\n")
    rc, out, _ = _cli(capsys, "render", "--config", "c.toml", "--sweep", sweep)
    assert rc == 0
    assert "#SBATCH --array=0-2" in out and "#SBATCH --ntasks=4" in out
    assert "'dp=2 pp=2 schedule=gpipe'" in out and "%A_%a" in out


@pytest.mark.parametrize("text, match", [
    ("dp=2 pipeline=3\n", "key in dp, pp, tp"),
    ("dp=two\n", "dp must be a positive integer"),
    ("# nothing\n\n", "no grids"),
])
def test_bad_sweep_file(text, match):
    with pytest.raises(slurm.SlurmError, match=match):
        slurm.parse_sweep(text)


def test_submit_without_sbatch_says_where_to_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    rc, out, err = _cli(capsys, "submit", "--config", "c.toml", "--dp", 2,
                        "--run-root", tmp_path / "runs")
    assert rc == 2 and out == ""
    assert "sbatch not found: run this on a Slurm login node or use mpiexec" in err


def test_checked_in_templates_match_the_renderer():
    for kind in ("train", "sweep"):
        text = (REPO / "slurm" / f"{kind}.sbatch").read_text()
        assert text == slurm.render_static(kind), \
            f"slurm/{kind}.sbatch is stale: python -c 'import mpipar.slurm as s; s.write_static()'"


def test_template_refuses_a_grid_larger_than_the_allocation(tmp_path):
    # The script's own guard, run outside Slurm: 4 ranks wanted, 2 tasks allocated.
    env = dict(os.environ, CONFIG="c.toml", DP="2", PP="2", SLURM_NTASKS="2",
               RUN_ROOT=str(tmp_path))
    proc = subprocess.run(["bash", str(REPO / "slurm" / "train.sbatch")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "needs 4 ranks but this allocation has 2 tasks" in proc.stderr


def _fake_job(tmp_path, run_name="", restart="0", srun_rc=0, **env):
    """train.sbatch outside Slurm with a fake srun that records what it was given: the
    script's own logic (run directory, stale exit codes, NOLOCAL detection, messages)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "NOLOCAL=${{MPIR_CVAR_NOLOCAL:-0}} $*" '
                                  f'> "{tmp_path}/srun.txt"\nexit {srun_rc}\n')
    (bin_dir / "srun").chmod(0o755)
    full = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "CONFIG": "c.toml",
            "RUN_ROOT": str(tmp_path / "runs"), "RUN_NAME": run_name, "SLURM_JOB_ID": "77",
            "SLURM_RESTART_COUNT": restart, "MPIPAR": f"{sys.executable} -m mpipar.cli",
            "PYTHONPATH": str(REPO), **env}
    return subprocess.run(["bash", str(REPO / "slurm" / "train.sbatch")], env=full,
                          capture_output=True, text=True, timeout=60)


def test_srun_nolocal_auto_asks_the_python_of_mpipar(tmp_path):
    """A shell without the venv: python3 on PATH is the system's; the wheel is in $MPIPAR's."""
    import importlib.metadata as md

    try:
        md.distribution("mpich")
    except md.PackageNotFoundError:
        pytest.skip("this python has no PyPI mpich wheel")
    proc = _fake_job(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "srun.txt").read_text().startswith("NOLOCAL=1 ")


def test_a_named_run_directory_is_found_again_and_its_old_exit_code_cleared(tmp_path):
    run_dir = tmp_path / "runs" / "exp1"
    run_dir.mkdir(parents=True)
    (run_dir / "slurm_exit").write_text("75\n")  # the previous incarnation's
    proc = _fake_job(tmp_path, run_name="exp1", srun_rc=3, restart="1")
    assert proc.returncode == 3
    assert f"--out {run_dir}\n" in (tmp_path / "srun.txt").read_text()
    assert (run_dir / "slurm_exit").read_text().strip() == "3"
    assert json.loads((run_dir / "slurm_job.json").read_text())["job"] == "77"
    assert "Job credential revoked" in proc.stderr and "resubmit it with RUN_NAME=exp1" \
        in proc.stderr, proc.stderr
    bad = _fake_job(tmp_path, run_name="../x")
    assert bad.returncode == 2 and "RUN_NAME must be a plain name" in bad.stderr


def test_dry_run_writes_the_script_it_prints(tmp_path, capsys):
    rc, out, err = _cli(capsys, "submit", "--config", "c.toml", "--dp", 2, "--dry-run",
                        "--run-root", tmp_path / "runs", "--name", "exp1")
    path = Path(err.split("sbatch --parsable ")[1].split()[0])
    assert rc == 0 and path.read_text() == out and "RUN_NAME=exp1" in out


def _state(job, state, reason=""):
    return slurm.JobState(job, state, "", reason)


def test_collect_lists_every_task_with_a_reason_and_fails_when_one_failed(tmp_path, capsys,
                                                                          monkeypatch):
    root = tmp_path / "runs"
    for task, code in ((0, 0), (1, 2), (3, 75), (4, None)):
        d = root / f"9_{task}"
        d.mkdir(parents=True)
        (d / "slurm_job.json").write_text(json.dumps({"job": f"9_{task}", "dp": 1}))
        if code is not None:  # task 4 was cancelled before the script could write one
            (d / "slurm_exit").write_text(f"{code}\n")
    (root / "9_0" / "metrics.json").write_text(json.dumps({"final_loss": 1.5}))
    (root / "slurm-9_1.out").write_text("mpipar train: error: model.kind = 'x' is unknown\n")
    states = [_state("9_0", "COMPLETED"), _state("9_1", "FAILED"),
              _state("9_2", "FAILED", "NonZeroExitCode"), _state("9_3", "PENDING", "BeginTime"),
              _state("9_4", "CANCELLED")]
    rows = slurm.collect(root, "9", states)
    by = {r["job"]: r for r in rows}
    assert [r["job"] for r in rows] == ["9_0", "9_1", "9_2", "9_3", "9_4"]
    assert by["9_4"]["state"] == "CANCELLED"  # not RUNNING?
    assert by["9_1"]["reason"] == "mpipar train: error: model.kind = 'x' is unknown"
    assert by["9_2"]["run_dir"] is None and "never started" in by["9_2"]["reason"]
    assert by["9_3"]["state"] == "PENDING"  # requeued: its old exit code 75 is not the state
    assert [r["job"] for r in slurm.failed_rows(rows)] == ["9_1", "9_2", "9_4"]
    # the CLI: the run root submit noted, several jobs, exit 1 when a task failed
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(slurm, "job_states", lambda job, env=None: states if job == "9" else [])
    slurm.remember("9", root)
    (root / "10").mkdir()
    (root / "10" / "slurm_exit").write_text("0\n")
    slurm.remember("10", root)
    rc, out, _ = _cli(capsys, "collect", "9", "10")
    assert rc == 1 and len(out.strip().splitlines()) == 7 and "never started" in out


# ---- a real cluster ----------------------------------------------------------------------

def _train_available() -> str | None:
    proc = subprocess.run([sys.executable, "-m", "mpipar.cli", "train", "--help"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return "`mpipar train` is not available yet"
    if not TINY.exists():
        return f"{TINY} is missing"
    return None


@pytest.fixture(scope="session")
def cluster():
    try:
        c = SlurmCluster.start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no local Slurm cluster: {exc}")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def train_ready():
    why = _train_available()
    if why:
        pytest.skip(why)


def _submit(cluster, run_root: Path, *argv) -> str:
    proc = subprocess.run([sys.executable, "-m", "mpipar.cli", "slurm", "submit",
                           "--config", TINY, "--run-root", run_root, *map(str, argv)],
                          capture_output=True, text=True, env={**cluster.env, **ONE_THREAD},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _wait(cluster, job_id: str) -> list[slurm.JobState]:
    try:
        return slurm.wait(job_id, JOB_TIMEOUT, env=cluster.env)
    except slurm.SlurmError as exc:
        slurm.cancel(job_id, env=cluster.env)
        pytest.fail(f"{exc}\n{cluster.log_tail('slurmctld')}")


# The PyPI mpich wheel under Slurm 22.05's PMI-2 plugin sometimes fails in MPI_Init before
# mpipar runs a line: slurmstepd logs "mpi/pmi2: invalid client request" (the client sent bytes
# of its own heap as a hex value) and UCX then rejects a garbled peer address. CI met it on two
# runs (one 2-rank array task each time); on a loaded machine it met this test's job twice in a
# row; slurm/README.md. Only the test of the srun path itself meets it; it tries again then,
# up to SRUN_ATTEMPTS jobs in all, as the emulated cluster's srun test does.
PMI2_STARTUP_FAILURE = ("mpi/pmi2: invalid client request", "Fatal error in internal_Init_thread")
SRUN_ATTEMPTS = 4
PMI2_HANG_GRACE = 30  # seconds a job may run on after its log shows the fault (then cancelled)


def _wait_srun(cluster, job: str, log: Path) -> tuple[list[slurm.JobState], bool]:
    """(the job's states once it has ended, whether its log shows the PMI-2 start-up fault).
    The fault either ends the step in MPI_Init or leaves its ranks blocked there until the job
    is killed: a job still running ``PMI2_HANG_GRACE`` s after its log first showed it is
    cancelled. Any other job still running after ``JOB_TIMEOUT`` fails the test."""
    deadline, seen = time.monotonic() + JOB_TIMEOUT, None
    while True:
        states = slurm.job_states(job, cluster.env)
        text = log.read_text(errors="replace") if log.is_file() else ""
        fault = PMI2_STARTUP_FAILURE[0] in text
        if states and not any(st.active for st in states):
            return states, fault
        now = time.monotonic()
        if fault and seen is None:
            seen = now
        if seen is not None and now - seen > PMI2_HANG_GRACE:
            slurm.cancel(job, env=cluster.env)
            return _wait(cluster, job), True
        if now > deadline:
            slurm.cancel(job, env=cluster.env)
            pytest.fail(f"job {job} still running after {JOB_TIMEOUT} s\n"
                        f"{cluster.log_tail('slurmctld')}")
        time.sleep(0.5)


def _run_srun_job(cluster, run_root: Path, *argv) -> tuple[str, list[slurm.JobState]]:
    """Submit with the default launcher (srun + PMI-2) and wait; resubmit when the job failed
    in MPI_Init with the wheel's PMI-2 fault, or hung there and was cancelled (``_wait_srun``),
    and on nothing else. When every attempt meets
    that fault the srun path cannot be tested with this wheel here: the test is skipped and
    says so (any other failure is returned, and fails the test)."""
    for attempt in range(1, SRUN_ATTEMPTS + 1):
        job = _submit(cluster, run_root, *argv)
        states, hung = _wait_srun(cluster, job, run_root / f"slurm-{job}.out")
        logs = [slurm.error_text(s, 200) for s in states if s.state != "COMPLETED"]
        failed_in_init = any(sig in log for log in logs for sig in PMI2_STARTUP_FAILURE)
        if not failed_in_init and not (hung and any(s.state != "COMPLETED" for s in states)):
            return job, states
        print(f"job {job} failed in MPI_Init (the wheel's PMI-2 fault, attempt {attempt} of "
              f"{SRUN_ATTEMPTS})")
    pytest.skip(f"the PyPI mpich wheel's PMI-2 start-up fault ended all {SRUN_ATTEMPTS} srun "
                "launches in MPI_Init (slurmstepd: 'mpi/pmi2: invalid client request'); the "
                "mpiexec launcher is tested by the other batch tests")


def _losses(trace: Path) -> np.ndarray:
    from mpipar.analysis import load

    return np.asarray(load(trace).metrics["loss"], dtype=np.float64)


GRID = ("--dp", 2, "--pp", 2, "--tp", 1, "--schedule", "1f1b", "--microbatches", 4,
        "--steps", 3)


def test_batch_job_trains_like_mpiexec(cluster, train_ready, tmp_path):
    job, states = _run_srun_job(cluster, tmp_path / "runs", *GRID)
    assert [s.state for s in states] == ["COMPLETED"], slurm.error_text(states[0], 40)
    run_dir = tmp_path / "runs" / job
    losses = _losses(run_dir / "trace.h5")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    info = json.loads((run_dir / "slurm_job.json").read_text())
    assert (info["dp"], info["pp"], info["tp"], info["ranks"]) == (2, 2, 1, 4)
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert metrics["final_loss"] == pytest.approx(losses[-1], rel=1e-12)

    # The same run under plain mpiexec: same ranks, same seed, same code -> same losses.
    ref = tmp_path / "mpiexec"
    run_mpi(4, [sys.executable, "-m", "mpipar.cli", "train", "--config", TINY, *GRID,
                "--out", ref], timeout=JOB_TIMEOUT, check=True)
    np.testing.assert_allclose(losses, _losses(ref / "trace.h5"), rtol=1e-12, atol=0)


def test_sweep_array_runs_every_grid(cluster, train_ready, tmp_path, capsys):
    sweep = tmp_path / "grids.txt"
    sweep.write_text("dp=1\ndp=2\npp=2 microbatches=2 schedule=gpipe\n")
    # Hydra inside the allocation: this test is about the array, not the launcher (the test
    # above covers srun), and srun + PMI-2 with the mpich wheel can fail in MPI_Init.
    job = _submit(cluster, tmp_path / "runs", "--sweep", sweep, "--steps", 2,
                  "--microbatches", 2, "--launcher", "mpiexec")
    states = _wait(cluster, job)
    assert sorted(s.job_id for s in states) == [f"{job}_{i}" for i in range(3)]
    failed = [s for s in states if s.state != "COMPLETED"]
    assert not failed, "\n".join(f"{s.job_id} {s.state}:\n{slurm.error_text(s, 40)}"
                                  for s in failed)
    rows = slurm.collect(tmp_path / "runs", job)
    assert [(r["dp"], r["pp"], r["tp"]) for r in rows] == [(1, 1, 1), (2, 1, 1), (1, 2, 1)]
    for r in rows:
        assert r["trace"] and len(_losses(Path(r["trace"]))) == 2
        assert np.isfinite(r["final_loss"])
    # The table of the sweep: `mpipar analyze` over the run root finds every dump.
    assert cli_main(["analyze", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert out.strip()
    assert cli_main(["slurm", "collect", job, "--run-root", str(tmp_path / "runs")]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4  # header + 3 grids


def test_failing_job_is_reported_with_its_error(cluster, train_ready, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nkind = "transformer"\n')  # not gpt or mlp
    direct = subprocess.run([sys.executable, "-m", "mpipar.cli", "train", "--config", bad,
                             "--out", tmp_path / "direct"], capture_output=True, text=True,
                            timeout=60)
    assert direct.returncode != 0 and direct.stderr.strip()
    message = direct.stderr.strip().splitlines()[-1]

    proc = subprocess.run([sys.executable, "-m", "mpipar.cli", "slurm", "submit", "--config",
                           bad, "--dp", "2", "--run-root", tmp_path / "runs", "--wait",
                           "--launcher", "mpiexec",  # the report, not the launcher, is tested
                           "--timeout", str(JOB_TIMEOUT)], capture_output=True, text=True,
                          env=cluster.env, timeout=JOB_TIMEOUT + 30)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout
    assert message in proc.stderr  # the job log's tail, shown by status


def test_scancel_stops_a_running_job(cluster, train_ready, tmp_path):
    job = _submit(cluster, tmp_path / "runs", "--dp", 2, "--steps", 100000,
                  "--launcher", "mpiexec")
    deadline = time.monotonic() + JOB_TIMEOUT
    while slurm.job_states(job, cluster.env)[0].state != "RUNNING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.1)
    cancel = subprocess.run([sys.executable, "-m", "mpipar.cli", "slurm", "cancel", job],
                            capture_output=True, text=True, env=cluster.env, timeout=60)
    assert cancel.returncode == 0, cancel.stderr
    states = _wait(cluster, job)
    assert states[0].state == "CANCELLED"
    status = subprocess.run([sys.executable, "-m", "mpipar.cli", "slurm", "status", job],
                            capture_output=True, text=True, env=cluster.env, timeout=60)
    assert status.returncode == 1 and "CANCELLED" in status.stdout


def test_preempted_job_requeues_and_resumes_exactly(cluster, train_ready, tmp_path):
    """USR1 to the batch shell (as --signal=B:USR1@90 sends before the time limit): the
    script forwards it, every rank stops after one step with a checkpoint (exit 75), the job
    requeues itself and resumes (--resume auto) to the loss of an uninterrupted run, bitwise
    in float64."""
    steps = 120  # enough that the signal arrives before the end, on a loaded machine too
    grid = ("--dp", 1, "--pp", 2, "--tp", 1, "--microbatches", 2, "--steps", steps)
    extra = "--dtype float64 --set train.eval_interval=0 --set run.flush_interval=2"
    run_dir, states, log = _preempt(cluster, tmp_path, grid, extra)
    assert [s.state for s in states] == ["COMPLETED"], log[-3000:]
    assert "finished with exit code 75" in log and "requeueing it" in log, log[-3000:]
    stopped = int(log.split("stopped after step ")[1].split(",")[0])
    assert 2 <= stopped < steps and f"resumed from {run_dir}" in log, log[-3000:]
    resumed = json.loads((run_dir / "metrics.json").read_text())
    assert (run_dir / "slurm_exit").read_text().strip() == "0"

    ref = tmp_path / "mpiexec"
    run_mpi(2, [sys.executable, "-m", "mpipar.cli", "train", "--config", TINY, *grid,
                *extra.split(), "--out", ref], timeout=JOB_TIMEOUT, check=True)
    whole = json.loads((ref / "metrics.json").read_text())
    assert resumed["steps"] == whole["steps"] == steps
    assert resumed["losses"] == whole["losses"]  # float64, bitwise, the predecessor's kept
    assert resumed["final_loss"] == whole["final_loss"]


def test_a_resubmitted_named_job_resumes_where_its_predecessor_stopped(cluster, train_ready,
                                                                       tmp_path):
    """No requeue: the stopped job ends (exit 75); the same submission with the same --name
    resumes from its checkpoint, and metrics.json holds the whole curve."""
    steps = 120
    args = ("--dp", 1, "--pp", 2, "--microbatches", 2, "--steps", steps, "--name", "exp",
            "--no-requeue", "--launcher", "mpiexec", "--extra-args",
            "--dtype float64 --set train.eval_interval=0 --set run.flush_interval=2")
    first = _submit(cluster, tmp_path / "runs", *args)
    run_dir = tmp_path / "runs" / "exp"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (run_dir / "trace.h5").exists():
        assert time.monotonic() < deadline, "the job never flushed its dump"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first], env=cluster.env, timeout=30)
    _wait(cluster, first)
    assert (run_dir / "slurm_exit").read_text().strip() == "75"
    second = _submit(cluster, tmp_path / "runs", *args)
    assert [s.state for s in _wait(cluster, second)] == ["COMPLETED"]
    log = (tmp_path / "runs" / f"slurm-{second}.out").read_text()
    assert f"resumed from {run_dir}" in log, log[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == steps and len(metrics["losses"]) == steps
    assert metrics["first_step"] == 0


def test_collect_shows_an_array_task_that_never_started(cluster, train_ready, tmp_path, capsys,
                                                        monkeypatch):
    """--array=0-2 over a 2-line sweep: task 2 dies before it creates its run directory."""
    sweep = tmp_path / "grids.txt"
    sweep.write_text("dp=1\ndp=2\n")
    script = tmp_path / "sweep.sbatch"
    assert cli_main(["slurm", "render", "--config", str(TINY), "--sweep", str(sweep),
                     "--steps", "1", "--launcher", "mpiexec", "--run-root",
                     str(tmp_path / "runs"), "-o", str(script)]) == 0
    (tmp_path / "runs").mkdir()
    proc = subprocess.run(["sbatch", "--parsable", "--array=0-2", str(script)],
                          capture_output=True, text=True, env=cluster.env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    _wait(cluster, job)
    capsys.readouterr()
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])  # collect asks this cluster
    rc = cli_main(["slurm", "collect", job, "--run-root", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert rc == 1 and len(out.strip().splitlines()) == 4, out  # header + 3 tasks
    assert f"{job}_2" in out and "has no line in the sweep" in out, out


def _preempt(cluster, root, grid, extra):
    """Submit, wait for the first dump flush, send USR1 to the batch shell, release the
    requeued job; returns (run directory, final states, the job's log)."""
    # mpiexec inside the allocation: on this one-node fixture, srun's pmi2 plugin fails the
    # requeued incarnation's MPI_Finalize ("failed to send temp kvs to compute nodes", the step
    # id of the first incarnation reused), after training has finished; see slurm/README.md
    job = _submit(cluster, root / "runs", *grid, "--launcher", "mpiexec",
                  "--extra-args", extra)
    run_dir = root / "runs" / job
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (run_dir / "trace.h5").exists():  # step 2 is done
        assert time.monotonic() < deadline, "the job never flushed its dump"
        time.sleep(0.1)
    sig = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True,
                         text=True, env=cluster.env, timeout=30)
    assert sig.returncode == 0, sig.stderr
    # A requeued job waits until the first incarnation's credential has expired (the fixture
    # sets cred_expire=10 s; Slurm's default is 120 s). Releasing it earlier makes slurmd
    # refuse it ("Job credential revoked") and the job ends FAILED: so just wait.
    log_path = run_dir.parent / f"slurm-{job}.out"
    while "resumed from" not in (log_path.read_text() if log_path.exists() else ""):
        assert time.monotonic() < deadline, \
            f"the job did not resume:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)
    states = _wait(cluster, job)
    return run_dir, states, Path(states[0].stdout).read_text(errors="replace")
