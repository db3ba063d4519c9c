"""Bad input on the command line and in files: one clear line that names the file or flag and
says what to change; never a bare UnicodeDecodeError, a BrokenPipe traceback or minutes of work."""

import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from mpi_util import ONE_THREAD, REPO

from mpipar.cli import EXIT_BROKEN_PIPE, main
from mpipar.config import ConfigError, load_config
from mpipar.trace import EVENT_DTYPE, write_dump

CONFIG = REPO / "experiments" / "configs" / "tiny.toml"


def _error(capfd, argv) -> str:
    assert main(argv) == 2, argv
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ----- config files ----------------------------------------------------------------------------

def test_a_binary_config_names_the_file(tmp_path):
    p = tmp_path / "model.toml"
    p.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"model\.toml is not UTF-8 text \(byte 0x80 at "
                                          r"offset 128\): a binary or damaged file"):
        load_config(p)


@pytest.mark.parametrize("offset", [0, 7, 40, 111])
def test_a_bit_flipped_config_names_the_file(tmp_path, offset):
    raw = bytearray(CONFIG.read_bytes())
    raw[offset % len(raw)] ^= 0x80  # high bit: never UTF-8 on its own
    p = tmp_path / "flipped.toml"
    p.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"flipped\.toml is not UTF-8 text"):
        load_config(p)


def test_a_broken_toml_line_names_the_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[train]\nlr = = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML: .*line 2"):
        load_config(p)


def test_cli_binary_config_is_one_line(tmp_path, capfd):
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\x00\xff\xfe" * 100)
    assert "bin.toml is not UTF-8" in _error(capfd, ["train", "--config", str(p)])


# ----- dumps -----------------------------------------------------------------------------------

def test_a_bit_flipped_dump_through_analyze(tmp_path, capfd):
    path = tmp_path / "trace.h5"
    ev = np.zeros(4, dtype=EVENT_DTYPE)
    ev["kind"] = b"F"
    write_dump(path, [ev], [{"dp": 0, "pp": 0, "tp": 0}],
               {"config": {}, "grid": {"dp": 1, "pp": 1, "tp": 1}, "world_size": 1})
    with h5py.File(path, "r") as f:
        offset = f["ranks/0/events"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset] = 0xC3  # the start of a two-byte UTF-8 sequence, cut short
    path.write_bytes(bytes(raw))
    err = _error(capfd, ["analyze", str(path)])
    assert str(path) in err and "damaged timing dump" in err and "re-run" in err


# ----- mpipar schedule ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--pp", "3000", "-m", "3000"], "9,000,000 cells is over the 4,096"),
    (["--pp", "0"], "--pp = 0: must be an integer >= 1"),
    (["-m", "-3"], "--microbatches/-m = -3"),
    (["--width", "0"], "--width = 0: the chart needs at least 20"),
    (["--costs", "F=nan"], "--costs F=nan: a cost must be a finite number >= 0"),
    (["--costs", "B=-1"], "--costs B=-1"),
    (["--costs", "F=inf"], "--costs F=inf"),
])
def test_schedule_refuses_absurd_arguments_quickly(capfd, argv, words):
    t0 = time.perf_counter()
    err = _error(capfd, ["schedule", *argv])
    assert words in err and time.perf_counter() - t0 < 5


def test_schedule_into_head_ends_quietly():
    """The reader leaves after one line: no BrokenPipe traceback, the SIGPIPE exit status."""
    proc = subprocess.Popen([sys.executable, "-m", "mpipar.cli", "schedule", "--pp", "16",
                             "-m", "64", "--actions"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **ONE_THREAD})
    proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == "", err
    assert proc.returncode in (0, EXIT_BROKEN_PIPE)


# ----- mpipar analyze ----------------------------------------------------------------------------

@pytest.fixture
def dump(tmp_path):
    from mpipar.analysis import synthetic as sy

    return sy.write(tmp_path / "t.h5", sy.pipeline_events(pp=2, microbatches=2, steps=2),
                    grid={"dp": 1, "pp": 2, "tp": 1})


@pytest.mark.parametrize("argv, words", [
    (["--peak", "-5"], "--peak = -5.0: the peak FLOP/s of one device must be a finite number"),
    (["--peak", "nan"], "--peak = nan"),
    (["--step", "-1"], "--step = -1"),
])
def test_analyze_refuses_absurd_flags(capfd, dump, argv, words):
    assert words in _error(capfd, ["analyze", str(dump), *argv])


def test_plots_into_an_unwritable_folder(capfd, dump, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a folder below a file cannot exist, even for root
    err = _error(capfd, ["analyze", str(dump), "--plots", str(blocker / "plots")])
    assert f"cannot write plots into {blocker / 'plots'}" in err and "--plots DIR" in err
    from mpipar.analysis import plots

    with pytest.raises(ValueError, match="cannot write plots into"):
        plots.timeline(dump, blocker / "plots" / "t.png")


# ----- schedule files: absurd headers and binary files -----------------------------------------

def test_a_tiny_schedule_file_claiming_a_huge_pp_is_refused_at_once(tmp_path):
    """65 bytes claiming pp=10**9: refused after looking for rank 1's line, not after listing
    10**9 ranks (a subprocess, so the old behaviour fails by its timeout, not by a hang)."""
    f = tmp_path / "big.txt"
    f.write_text("schedule kind=1f1b pp=1000000000 virtual=1 microbatches=2\nrank 0: F0.0\n")
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "schedule", "--file", str(f)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "no 'rank 1:' line" in res.stderr, res.stderr


@pytest.mark.parametrize("name, words", [("s.txt", "schedule file "), ("s.csv", "torch CSV ")])
def test_a_binary_schedule_file_names_the_file(capfd, tmp_path, name, words):
    f = tmp_path / name
    f.write_bytes(bytes(range(256)) * 4)
    err = _error(capfd, ["schedule", "--file", str(f)])
    assert f"{words}{f} is not text" in err, err


# ----- prepare-data: absurd sizes and unwritable places -----------------------------------------

def test_prepare_data_refuses_a_huge_vocabulary(capfd, tmp_path):
    err = _error(capfd, ["prepare-data", "--synthetic", "pattern", "--tokens", "1000",
                         "--vocab", "5000000000", "--out", str(tmp_path / "t.h5")])
    assert "--vocab 5000000000: a synthetic vocabulary must be from 2 to" in err, err


def test_prepare_data_into_an_unwritable_place_names_the_users_path(capfd, tmp_path):
    """(A folder under a file: unwritable even for root, unlike a chmod-ed folder.)"""
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "t.h5"
    err = _error(capfd, ["prepare-data", "--synthetic", "pattern", "--tokens", "1000",
                         "--out", str(target)])
    assert f"could not write {target}: {tmp_path / 'afile'} is a file, not a folder" in err, err
    assert ".tmp" not in err


def test_a_failed_write_names_the_file_not_the_temporary(tmp_path):
    from mpipar.files import write_text_atomic

    target = tmp_path / "sub"
    target.mkdir()
    with pytest.raises(OSError, match=f"could not write {target}: Is a directory") as exc:
        write_text_atomic(target, "x")
    assert ".tmp" not in str(exc.value)


def test_an_unwritable_chrome_trace_is_refused_before_the_analysis(capfd, tmp_path):
    """Checked with the arguments, as --plots is: the dump (here absent) is not even read."""
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "t.json"
    err = _error(capfd, ["analyze", str(tmp_path / "missing.h5"), "--chrome-trace", str(target)])
    assert f"cannot write the chrome trace to {target}" in err and "--chrome-trace" in err, err
