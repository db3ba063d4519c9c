"""One failing rank ends the whole job quickly, with a non-zero status and its traceback."""

import sys

import pytest
from mpi_util import python_script


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["hook", "guard"])
def test_exception_aborts_job(mode):
    # the other ranks block in a receive / barrier forever; the timeout turns a hang into a failure
    p = python_script(4, "failfast_raise.py", mode, timeout=60)
    assert p.returncode != 0
    assert "[mpipar] rank 3 (host " in p.stderr, p.stderr
    assert "RuntimeError: deliberate failure on rank 3" in p.stderr, p.stderr
    assert "Traceback (most recent call last)" in p.stderr
    assert "unreachable" not in p.stdout


@pytest.mark.mpi
def test_nonzero_exit_aborts_job():
    p = python_script(2, "failfast_raise.py", "exit", timeout=60)
    assert p.returncode != 0
    assert "[mpipar] rank 1 (host " in p.stderr and "exited with status 3" in p.stderr, p.stderr


@pytest.mark.mpi
def test_a_start_failing_on_one_rank_ends_every_rank_with_one_message():
    p = python_script(4, "failfast_raise.py", "start", timeout=60)
    assert p.returncode == 2, p.stderr
    # mpiexec forwards each rank's stdout on its own; lines of ranks printing at once may
    # arrive run together, so look for each rank's line rather than split on newlines
    for r in range(4):
        assert p.stdout.count(f"rank {r} start code 2") == 1, p.stdout
    assert p.stderr.count("config file c.toml not found") == 1, p.stderr
    assert "mpipar train: error: rank 3 (host " in p.stderr


@pytest.mark.mpi
def test_a_bad_config_under_mpiexec_is_said_once(tmp_path):
    from mpi_util import run_mpi

    p = run_mpi(4, [sys.executable, "-m", "mpipar.cli", "train", "--set", "train.lrr=1",
                    "--out", str(tmp_path)], timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("unknown config key train.lrr") == 1, p.stderr


def test_guard_passes_success_and_zero_exit():
    from mpipar.mpi import failfast

    with failfast.guard():
        x = 1
    assert x == 1
    with pytest.raises(SystemExit):
        with failfast.guard():
            raise SystemExit(0)
