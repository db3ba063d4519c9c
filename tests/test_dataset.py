"""Token files: preparing, validating, batching; baselines; synthetic MLP tasks."""

import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpipar import datasets
from mpipar.datasets import (
    DataError,
    TokenDataset,
    prepare_corpus,
    prepare_synthetic,
    synthetic_classification,
    synthetic_regression,
    unigram_entropy,
)


@pytest.fixture
def source_dir(tmp_path):
    """A tiny 'library' of *.py files (plus things that must be skipped)."""
    src = tmp_path / "lib"
    rng = np.random.default_rng(0)
    for i in range(12):
        sub = src / ("pkg" if i % 3 else "") / f"mod_{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        words = rng.choice(["def", "return", "x", "=", "1", "(", ")", ":", "\n", "    "], 400)
        sub.write_text(f"# module {i}\n" + " ".join(words))
    for skipped in ("site-packages/skip.py", "test/test_x.py", "__pycache__/c.py", "notes.txt"):
        (src / skipped).parent.mkdir(parents=True, exist_ok=True)
        (src / skipped).write_text("SKIPPED " * 50)
    return src


@pytest.fixture
def corpus(tmp_path, source_dir):
    out = tmp_path / "c.h5"
    stats = prepare_corpus(out, source_dir=source_dir, val_fraction=0.25)
    return out, stats


def test_prepare_corpus_round_trip(corpus, source_dir):
    out, stats = corpus
    ds = TokenDataset(out)
    assert ds.vocab_size == 256 and ds.kind == "bytes"
    assert stats["n_files"] == 12 and stats["n_train_files"] + stats["n_val_files"] == 12
    assert stats["n_val_files"] >= 1 and stats["n_train_files"] >= 1
    with h5py.File(out) as f:
        for key in ("vocab_size", "kind", "source", "n_files", "created", "format_version",
                    "sha256", "unigram_val_loss"):
            assert key in f.attrs, key
        assert f["train"].dtype == np.uint8 and f["val"].dtype == np.uint8
        val_files = [s.decode() for s in f["val_files"][()]]
    # the val split is exactly the val files' headers + bytes, in sorted order
    expect = b"".join(datasets.file_header(rel) + (source_dir / rel).read_bytes()
                      for rel in sorted(val_files))
    assert ds.tokens["val"].tobytes() == expect
    assert b"SKIPPED" not in ds.tokens["train"].tobytes() + expect
    assert ds.unigram_val_loss == pytest.approx(
        unigram_entropy(ds.tokens["val"], 256, train_tokens=ds.tokens["train"]))
    assert 0 < ds.unigram_val_loss < math.log(256)
    # deterministic: same tokens again
    again = prepare_corpus(out.with_name("again.h5"), source_dir=source_dir, val_fraction=0.25)
    assert again["sha256"] == stats["sha256"]


def test_max_bytes_caps_and_keeps_both_splits(tmp_path, source_dir):
    stats = prepare_corpus(tmp_path / "small.h5", source_dir=source_dir, val_fraction=0.25,
                           max_bytes=4000)
    assert stats["n_train"] + stats["n_val"] <= 4000
    assert stats["n_train"] > 0 and stats["n_val"] > 0


def test_real_stdlib_corpus_small(tmp_path):
    stats = prepare_corpus(tmp_path / "std.h5", max_bytes=100_000)
    ds = TokenDataset(tmp_path / "std.h5")
    assert 90_000 < len(ds) <= 100_000
    assert "python" in stats["source"]
    text = ds.tokens["train"].tobytes()
    assert b"def " in text and b"import" in text
    # Python source: the unigram loss is well under uniform (ln 256 = 5.55), around 3 nats
    assert 2.0 < ds.unigram_val_loss < 4.5


def test_batches_deterministic_and_shifted(corpus):
    ds = TokenDataset(corpus[0])
    x, y = ds.get_batch("train", step=3, batch_size=4, seq_len=16, seed=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
    x2, y2 = ds.get_batch("train", step=3, batch_size=4, seq_len=16, seed=7)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert np.array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    stream = ds.tokens["train"].tobytes()
    for row_x, row_y in zip(x, y, strict=True):  # each row is a real window of the stream
        window = bytes(row_x.astype(np.uint8)) + bytes(row_y[-1:].astype(np.uint8))
        assert window in stream
    assert not np.array_equal(x, ds.get_batch("train", 4, 4, 16, 7)[0])  # other step
    assert not np.array_equal(x, ds.get_batch("train", 3, 4, 16, 8)[0])  # other seed
    assert not np.array_equal(x, ds.get_batch("val", 3, 4, 16, 7)[0])  # other split


def test_batch_errors(corpus):
    ds = TokenDataset(corpus[0])
    n = ds.split_len("val")
    ds.get_batch("val", 0, 2, n - 1, 0)  # the longest window that fits
    with pytest.raises(DataError, match="seq_len"):
        ds.get_batch("val", 0, 2, n, 0)
    with pytest.raises(ValueError, match="split"):
        ds.get_batch("test", 0, 2, 4, 0)
    with pytest.raises(ValueError, match="batch_size"):
        ds.get_batch("train", 0, 0, 4, 0)


def test_missing_file_names_path_and_fix(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError, match=r"nope\.h5.*mpipar prepare-data"):
        TokenDataset(missing)


def test_not_hdf5_and_truncated(tmp_path, corpus):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(DataError, match="not a readable HDF5"):
        TokenDataset(junk)
    data = corpus[0].read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.h5 .*truncated"):
        TokenDataset(cut)


def _write(path, train, val, **attrs):
    base = {"vocab_size": 256, "format_version": 1,
            "sha256": datasets.tokens_sha256(np.asarray(train), np.asarray(val))}
    with h5py.File(path, "w") as f:
        if train is not None:
            f["train"] = train
        f["val"] = val
        for k, v in {**base, **attrs}.items():
            f.attrs[k] = v


def test_malformed_files(tmp_path):
    good = np.arange(100, dtype=np.uint8)
    cases = {
        "no_train.h5": (dict(train=None, val=good), "no dataset"),
        "float.h5": (dict(train=good.astype(np.float32), val=good), "unsigned integer"),
        "big_token.h5": (dict(train=good, val=good, vocab_size=50), "token 99.*vocabulary of 50"),
        "version.h5": (dict(train=good, val=good, format_version=7), "format_version 7"),
        "tampered.h5": (dict(train=good, val=good, sha256="0" * 64), "sha256"),
        "tiny.h5": (dict(train=good, val=good[:1]), "at least 2"),
    }
    for name, (kw, msg) in cases.items():
        path = tmp_path / name
        train, val = kw.pop("train"), kw.pop("val")
        _write(path, train, val, **kw)
        with pytest.raises(DataError, match=msg):
            TokenDataset(path)
        assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("kind", ["pattern", "markov", "uniform"])
def test_synthetic_sets(tmp_path, kind):
    out = tmp_path / f"{kind}.h5"
    stats = prepare_synthetic(out, kind, n_tokens=5000, vocab=20, seed=3)
    ds = TokenDataset(out)
    assert ds.vocab_size == 20 and ds.kind == f"synthetic:{kind}"
    assert stats["n_train"] == 4500 and stats["n_val"] == 500
    assert 0 < stats["entropy_rate"] <= math.log(20) + 1e-12
    if kind != "uniform":  # learnable: far below what a context-free model gets
        assert stats["entropy_rate"] < 0.5 * ds.unigram_val_loss
    x, y = ds.get_batch("train", 0, 2, 8, 0)
    assert x.max() < 20
    again = prepare_synthetic(tmp_path / "again.h5", kind, 5000, 20, 3)
    assert again["sha256"] == stats["sha256"]
    assert prepare_synthetic(tmp_path / "other.h5", kind, 5000, 20, 4)["sha256"] != stats["sha256"]


def test_synthetic_large_vocab_uses_uint16(tmp_path):
    prepare_synthetic(tmp_path / "v.h5", "uniform", 1000, 1000, 0)
    ds = TokenDataset(tmp_path / "v.h5")
    assert ds.tokens["train"].dtype == np.uint16 and ds.tokens["train"].max() >= 256


def test_unigram_entropy_known_values():
    # empirical entropy of a known distribution (no smoothing): p = (1/2, 1/4, 1/4)
    tokens = np.array([0, 0, 1, 2] * 25)
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert unigram_entropy(tokens, 3, smoothing=0.0) == pytest.approx(h, rel=1e-14)
    # a uniform sequence over the vocabulary: ln V, smoothing or not
    assert unigram_entropy(np.arange(8), 8) == pytest.approx(math.log(8), rel=1e-14)
    # add-one smoothing from train counts: train [0, 0] over vocab 2 -> p = (3/4, 1/4)
    assert unigram_entropy([1], 2, train_tokens=[0, 0]) == pytest.approx(-math.log(0.25))
    assert unigram_entropy([1], 2, train_tokens=[0, 0], smoothing=0.0) == math.inf


def test_synthetic_mlp_tasks():
    x, y = synthetic_regression(64, 5, 3, seed=1)
    assert x.shape == (64, 5) and y.shape == (64, 3)
    assert x.dtype == y.dtype == np.float64 and np.std(y) > 0.05
    x2, y2 = synthetic_regression(64, 5, 3, seed=1)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    # the teacher is fixed by the seed: more samples extend the same task
    xb, yb = synthetic_regression(128, 5, 3, seed=1)
    assert np.allclose(yb[:64], y)
    xc, yc = synthetic_classification(500, 6, 4, seed=2)
    assert xc.dtype == np.float64 and yc.dtype == np.int64 and yc.shape == (500,)
    assert set(np.unique(yc)) <= set(range(4)) and len(np.unique(yc)) >= 3  # not degenerate


def test_default_path_and_ensure(tmp_path, monkeypatch):
    p = datasets.default_corpus_path()
    assert p.name == datasets.CORPUS_NAME
    target = tmp_path / "sub" / "corpus.h5"
    got = datasets.ensure_corpus(target, max_bytes=20_000)
    assert got == target and TokenDataset(target).vocab_size == 256
    mtime = target.stat().st_mtime_ns
    datasets.ensure_corpus(target)  # exists: not rebuilt
    assert target.stat().st_mtime_ns == mtime
    assert not [q for q in target.parent.iterdir() if q.name.endswith(".tmp")]  # no temp left


def test_cli_prepare_data(tmp_path, source_dir):
    out = tmp_path / "cli.h5"
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "prepare-data", "--out", str(out),
                          "--source-dir", str(source_dir), "--max-bytes", "50000"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "unigram val loss" in res.stdout and Path(out).exists()
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "prepare-data", "--out",
                          str(tmp_path / "s.h5"), "--synthetic", "pattern", "--tokens", "3000",
                          "--vocab", "16"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "entropy rate" in res.stdout


def test_concurrent_prepare_is_atomic(tmp_path):
    """Several processes (like MPI ranks) preparing the same file at once: no error, one valid
    file, no temp files left."""
    target = tmp_path / "shared.h5"
    code = ("import sys; from mpipar.datasets import prepare_corpus; "
            "prepare_corpus(sys.argv[1], max_bytes=30_000)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target)]) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert TokenDataset(target).split_len("train") > 0
    assert [q.name for q in tmp_path.iterdir()] == ["shared.h5"]
