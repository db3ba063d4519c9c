"""Checkpoints that cannot lie: a checksum per tensor, exact names and shapes, and the atomic
writer's promises (fsync, stale temporaries, permissions under the umask)."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from mpi_util import ONE_THREAD

from mpipar import files
from mpipar.backend import Backend
from mpipar.checkpoint import CheckpointError, _write, check_contents, digest, read_checkpoint
from mpipar.config import Config, ModelConfig
from mpipar.models import build_model


def _save(directory, tensors, step=3):
    trainer = SimpleNamespace(cfg=Config(), step=step, opt=SimpleNamespace(step_count=step))
    return _write(directory, trainer, tensors)


def _tensors():
    rng = np.random.default_rng(0)
    return {"params/a.weight": rng.standard_normal((4, 3)),
            "params/b.bias": rng.standard_normal(5).astype(np.float32),
            "optim/a.weight/exp_avg": np.zeros((4, 3))}


def test_round_trip_with_checksums(tmp_path):
    path = _save(tmp_path, _tensors())
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 2
        assert f["params/a.weight"].attrs["sha256"] == digest(_tensors()["params/a.weight"])
    got, attrs = read_checkpoint(path)
    assert set(got) == set(_tensors()) and attrs["step"] == 3
    for k, v in _tensors().items():
        np.testing.assert_array_equal(got[k], v)
    assert (tmp_path / "latest").read_text().strip() == path.name


@pytest.mark.parametrize("name", ["params/a.weight", "params/b.bias", "optim/a.weight/exp_avg"])
def test_a_flipped_byte_is_refused_naming_the_tensor(tmp_path, name):
    path = _save(tmp_path, _tensors())
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset() + 3  # a byte inside this tensor's data
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"tensor {name} does not match its sha256"):
        read_checkpoint(path)


def test_a_missing_checksum_in_format_2_is_refused(tmp_path):
    path = _save(tmp_path, _tensors())
    with h5py.File(path, "a") as f:
        del f["params/b.bias"].attrs["sha256"]
    with pytest.raises(CheckpointError, match="params/b.bias has no sha256"):
        read_checkpoint(path)


def test_format_1_without_checksums_loads_with_a_warning(tmp_path, capsys):
    path = _save(tmp_path, _tensors())
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = 1
        for k in _tensors():
            del f[k].attrs["sha256"]
    got, _ = read_checkpoint(path)
    assert set(got) == set(_tensors())
    assert "format 1" in capsys.readouterr().err


def _shapes(n_layer):
    m = build_model(ModelConfig(n_layer=n_layer, n_embd=16, n_head=2, block_size=8),
                    Backend("cpu", "float64"))
    return {p.name: p.full_shape for p in m.params()}


def _as_file_tensors(shapes, buffers):
    t = {f"params/{n}": np.zeros(s) for n, s in shapes.items()}
    t.update({f"optim/{n}/{b}": np.zeros(s) for n, s in shapes.items() for b in buffers})
    return t


def test_a_deeper_checkpoint_into_a_shallower_model_names_the_extra_tensors():
    bufs = ["exp_avg", "exp_avg_sq"]
    with pytest.raises(CheckpointError, match=r"has \d+ tensor\(s\) the model does not: "
                                              r"optim/blocks.2.") as err:
        check_contents("ck.h5", _as_file_tensors(_shapes(4), bufs), _shapes(2), bufs)
    assert "lacks" not in str(err.value) and "n_layer" in str(err.value)
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensor\(s\) the model has: "
                                              r"optim/blocks.2.") as err:
        check_contents("ck.h5", _as_file_tensors(_shapes(2), bufs), _shapes(4), bufs)
    assert "does not" not in str(err.value)
    check_contents("ck.h5", _as_file_tensors(_shapes(2), bufs), _shapes(2), bufs)


def test_a_wrong_shape_names_the_tensor():
    shapes = _shapes(2)
    t = _as_file_tensors(shapes, ["momentum_buffer"])
    t["params/blocks.0.mlp.fc.weight"] = np.zeros((3, 3))
    with pytest.raises(CheckpointError, match=r"blocks.0.mlp.fc.weight .* has shape \(3, 3\)"):
        check_contents("ck.h5", t, shapes, ["momentum_buffer"])


# ----- end to end: a 4-layer checkpoint into a 2-layer run and back, through the CLI ----------

def _train(tmp_path, name, *extra):
    out = tmp_path / name
    cmd = [sys.executable, "-m", "mpipar.cli", "train", "--out", str(out), "--quiet",
           "--steps", "2", "--dtype", "float64", "--batch-size", "8",
           "--set", "model.kind=mlp", "--set", "run.checkpoint_final=true",
           "--set", "train.eval_interval=0", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **ONE_THREAD})
    return out, res


def test_cli_refuses_a_checkpoint_of_another_depth(tmp_path):
    deep, res = _train(tmp_path, "deep", "--set", "model.sizes=[8,16,16,16,4]")
    assert res.returncode == 0, res.stderr
    shallow, res = _train(tmp_path, "shallow", "--set", "model.sizes=[8,16,4]")
    assert res.returncode == 0, res.stderr
    ck_deep = deep / "checkpoints" / "step_000002.h5"
    _, res = _train(tmp_path, "a", "--set", "model.sizes=[8,16,4]", "--resume", str(ck_deep))
    assert res.returncode == 2 and "the model does not" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    _, res = _train(tmp_path, "b", "--set", "model.sizes=[8,16,16,16,4]",
                    "--resume", str(shallow / "checkpoints" / "step_000002.h5"))
    assert res.returncode == 2 and "lacks" in res.stderr, res.stderr
    # a flipped byte in a saved tensor: refused, the tensor named
    with h5py.File(ck_deep, "r") as f:
        name = sorted(k for k in f["params"])[0]
        offset = f[f"params/{name}"].id.get_offset()
    raw = bytearray(ck_deep.read_bytes())
    raw[offset + 5] ^= 0xFF
    ck_deep.write_bytes(bytes(raw))
    _, res = _train(tmp_path, "c", "--set", "model.sizes=[8,16,16,16,4]",
                    "--resume", str(ck_deep))
    assert res.returncode == 2 and f"params/{name} does not match" in res.stderr, res.stderr


# ----- the atomic writer ------------------------------------------------------------------------

@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_files_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        files.write_text_atomic(tmp_path / "x.txt", "hi")
        with files.atomic_h5(tmp_path / "x.h5") as f:
            f["a"] = np.zeros(2)
    finally:
        os.umask(old)
    assert (tmp_path / "x.txt").stat().st_mode & 0o777 == mode
    assert (tmp_path / "x.h5").stat().st_mode & 0o777 == mode


def test_durable_writes_fsync_the_file_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"),
                                                     real_replace(a, b))[1])
    with files.atomic_path(tmp_path / "x.bin", durable=True) as tmp:
        open(tmp, "wb").write(b"data")
    assert events[:2] == ["fsync", "replace"]
    assert (tmp_path / "x.bin").read_bytes() == b"data"


def test_checkpoints_are_durable(tmp_path, monkeypatch):
    calls = []
    real = files.atomic_path

    def spy(path, durable=False):
        calls.append((os.path.basename(path), durable))
        return real(path, durable)

    monkeypatch.setattr(files, "atomic_path", spy)
    _save(tmp_path, _tensors())
    assert ("step_000003.h5", True) in calls


def test_stale_temporaries_of_the_same_target_are_removed(tmp_path):
    old = time.time() - 2 * files.STALE_AFTER_S
    stale = tmp_path / ".step_000003.h5.abcd_123.tmp"
    fresh = tmp_path / ".step_000003.h5.zzzz9999.tmp"  # a write in progress elsewhere
    other = tmp_path / ".notes.txt.abcd1234.tmp"  # another target's
    mine = tmp_path / "step_000003.h5.bak"  # not the pattern
    for p in (stale, fresh, other, mine):
        p.write_bytes(b"x")
    for p in (stale, other, mine):
        os.utime(p, (old, old))
    _save(tmp_path, _tensors())
    assert not stale.exists()
    assert fresh.exists() and other.exists() and mine.exists()
    assert files.remove_stale_temporaries(tmp_path / "notes.txt") == [str(other)]
