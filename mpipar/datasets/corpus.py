"""The byte-level corpus built from this machine's Python standard library (no download).

The corpus is the ``*.py`` files of the standard library (``sysconfig.get_paths()["stdlib"]``),
read as bytes (vocabulary 256), so a GPT trained on it learns real structure (indentation,
keywords, names) and its loss can be compared against the unigram baseline stored in the file.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .tokens import SPLITS, DataError, tokens_sha256, unigram_entropy, write_token_file

# Skipped while walking the standard library: installed packages, and (by default) the test
# suites, which are large, repetitive and full of deliberately odd code.
_SKIP_ALWAYS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(source_dir, include_tests: bool = False) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every ``*.py`` under ``source_dir``, sorted by the relative
    path, skipping site-packages, __pycache__ and (unless ``include_tests``) test folders."""
    root = Path(source_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"source folder {root} does not exist or is not a folder")
    skip = _SKIP_ALWAYS | (set() if include_tests else _TEST_DIRS)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked folders
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda t: t[0])
    return found


def _split_key(rel: str) -> float:
    """A file's position in [0, 1) from the hash of its relative path: stable across machines and
    Python versions, and independent of which other files exist."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2.0**64


def file_header(rel: str) -> bytes:
    """The separator put before each file's bytes (a Python comment naming the file)."""
    return f"\n# ==== {rel} ====\n".encode()


def prepare_corpus(out_path, source_dir=None, val_fraction: float = 0.1,
                   max_bytes: int = 16 * 2**20, include_tests: bool = False) -> dict:
    """Build the byte-level corpus from the ``*.py`` files under ``source_dir`` (default: the
    standard library) and write it to ``out_path``. Returns the stats (also stored as attrs).

    Split, by file: a file goes to ``val`` when the hash of its relative path, read as a number in
    [0, 1), is below ``val_fraction`` (so about that fraction of the files; if no file or every
    file lands there, the file with the smallest / largest hash is moved). Each split concatenates
    its files in sorted path order, each preceded by ``file_header``. ``max_bytes`` caps the total:
    when the files hold more, each split keeps its share of ``max_bytes`` (in proportion to its
    uncapped size), taking whole files in sorted order and cutting the last one.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes < 1024:
        raise ValueError(f"max_bytes must be at least 1024, got {max_bytes}")
    src = stdlib_dir() if source_dir is None else Path(source_dir)
    files = list_source_files(src, include_tests=include_tests)
    if len(files) < 2:
        raise DataError(f"need at least 2 *.py files under {src} to make a train/val split, "
                        f"found {len(files)}")
    keys = {rel: _split_key(rel) for rel, _ in files}
    in_val = {rel: keys[rel] < val_fraction for rel, _ in files}
    if not any(in_val.values()):
        in_val[min(keys, key=keys.get)] = True
    if all(in_val.values()):
        in_val[max(keys, key=keys.get)] = False

    # Bytes each split would hold uncapped (stat sizes; files are read once, below). Over
    # max_bytes, both splits shrink in proportion so the cap keeps the split's ratio.
    full = {"train": 0, "val": 0}
    for rel, path in files:
        full["val" if in_val[rel] else "train"] += len(file_header(rel)) + path.stat().st_size
    total = full["train"] + full["val"]
    budget = {s: (full[s] if total <= max_bytes else full[s] * max_bytes // total) for s in SPLITS}
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    used = {"train": 0, "val": 0}
    names: dict[str, list[str]] = {"train": [], "val": []}
    unreadable = 0
    for rel, path in files:
        split = "val" if in_val[rel] else "train"
        room = budget[split] - used[split]
        if room <= 0:
            if all(budget[s] - used[s] <= 0 for s in SPLITS):
                break
            continue
        try:
            content = path.read_bytes()
        except OSError:
            unreadable += 1
            continue
        chunk = (file_header(rel) + content)[:room]
        parts[split].append(chunk)
        names[split].append(rel)
        used[split] += len(chunk)
    train = np.frombuffer(b"".join(parts["train"]), dtype=np.uint8).copy()
    val = np.frombuffer(b"".join(parts["val"]), dtype=np.uint8).copy()
    if train.size < 2 or val.size < 2:
        raise DataError(f"corpus from {src} came out too small (train {train.size}, val {val.size} "
                        "bytes); raise max_bytes or use a folder with more *.py files")

    uni = unigram_entropy(val, 256, train_tokens=train)
    source = (f"*.py under {src} (python {platform.python_version()}"
              f"{', with tests' if include_tests else ', tests skipped'})")
    attrs = {
        "vocab_size": 256,
        "kind": "bytes",
        "source": source,
        "n_files": len(names["train"]) + len(names["val"]),
        "n_train_files": len(names["train"]),
        "n_val_files": len(names["val"]),
        "val_fraction": float(val_fraction),
        "max_bytes": int(max_bytes),
        "split_rule": "by file: sha256(relative path)[:8]/2**64 < val_fraction -> val",
        "unigram_val_loss": uni,
    }
    path = write_token_file(out_path, train, val, attrs,
                            {"train_files": names["train"], "val_files": names["val"]})
    return {"path": str(path), **attrs, "n_train": int(train.size), "n_val": int(val.size),
            "unreadable_files": unreadable, "sha256": tokens_sha256(train, val),
            "uniform_loss": math.log(256)}


# ----- the default corpus ---------------------------------------------------------------------

CORPUS_NAME = "stdlib_corpus.h5"


def _repo_root() -> Path | None:
    """The source checkout holding this package, or None when installed elsewhere."""
    root = Path(__file__).resolve().parents[2]  # mpipar/datasets/corpus.py -> the checkout
    if (root / "setup.cfg").exists() or (root / "pyproject.toml").exists():
        return root
    return None


def default_corpus_path() -> Path:
    """data/stdlib_corpus.h5 in the source checkout if that folder is writable, else
    $XDG_CACHE_HOME/mpipar (default ~/.cache/mpipar)/stdlib_corpus.h5."""
    root = _repo_root()
    if root is not None:
        data = root / "data"
        if (data.is_dir() and os.access(data, os.W_OK)) or (
                not data.exists() and os.access(root, os.W_OK)):
            return data / CORPUS_NAME
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpipar"
    return cache / CORPUS_NAME


def ensure_corpus(path=None, **kwargs) -> Path:
    """The corpus path, preparing the file first if it does not exist (``kwargs`` go to
    ``prepare_corpus``). Call on one rank then barrier; the write is atomic regardless."""
    target = Path(path).expanduser() if path is not None else default_corpus_path()
    if not target.exists():
        stats = prepare_corpus(target, **kwargs)
        print(f"[mpipar] prepared {target}: {stats['n_files']} files, train {stats['n_train']:,} / "
              f"val {stats['n_val']:,} bytes", file=sys.stderr)
    return target
