"""Token data: a byte-level corpus built from this machine's Python standard library, synthetic
token sets and regression / classification tasks for tests, and the reader the training loop uses.

No download is ever needed. The corpus is the ``*.py`` files of the standard library
(``sysconfig.get_paths()["stdlib"]``), read as bytes (vocabulary 256), so a GPT trained on it
learns real structure (indentation, keywords, names) and its loss can be compared against the
unigram baseline stored in the file.

File format (HDF5, ``format_version`` 1), see data/README.md:

- datasets ``train`` and ``val``: 1-D unsigned integer tokens (``uint8`` for vocabularies up to 256)
- attrs ``vocab_size``, ``kind`` ("bytes" or "synthetic:<kind>"), ``source``, ``n_files``,
  ``created`` (ISO 8601), ``format_version``, ``sha256`` (of ``train`` bytes then ``val`` bytes),
  ``unigram_val_loss`` (nats/token: val under add-one smoothed train unigram counts)

Batches are a pure function of (seed, split, step): every rank draws the same full batch and
the data-parallel caller takes its rows, so any grid sees the same data (DESIGN.md contract 1).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import platform
import sys
import sysconfig
import uuid
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
SPLITS = ("train", "val")
_SPLIT_ID = {"train": 0, "val": 1}
# Skipped while walking the standard library: installed packages, and (by default) the test
# suites, which are large, repetitive and full of deliberately odd code.
_SKIP_ALWAYS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
FIX_HINT = "run `mpipar prepare-data` (or pass --data PATH to an existing token file)"


class DataError(ValueError):
    """A token file exists but is not usable; the message names what is wrong and the fix."""


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def unigram_entropy(tokens, vocab: int, train_tokens=None, smoothing: float = 1.0) -> float:
    """Cross-entropy in nats/token of ``tokens`` under a unigram model.

    The model's probabilities are the counts of ``train_tokens`` (default: ``tokens`` itself) plus
    ``smoothing`` per symbol, normalised. With ``smoothing=0`` and no ``train_tokens`` this is the
    plain empirical entropy. A model that ignores context cannot beat this on ``tokens``; the
    training loop prints its val loss beside it.
    """
    tokens = np.asarray(tokens).ravel()
    ref = tokens if train_tokens is None else np.asarray(train_tokens).ravel()
    if tokens.size == 0:
        raise ValueError("unigram_entropy: no tokens to evaluate")
    counts = np.bincount(ref, minlength=vocab).astype(np.float64)
    if counts.size > vocab:
        raise ValueError(f"unigram_entropy: token {ref.max()} is outside the vocabulary "
                         f"of {vocab}")
    probs = (counts + smoothing) / (counts.sum() + smoothing * vocab)
    eval_counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    if eval_counts.size > vocab:
        raise ValueError(f"unigram_entropy: token {tokens.max()} is outside the vocabulary "
                         f"of {vocab}")
    used = eval_counts > 0
    if np.any(probs[used] == 0):
        return math.inf  # a token never seen in training with no smoothing
    return float(-(eval_counts[used] * np.log(probs[used])).sum() / tokens.size)


# ---------------------------------------------------------------------------------------------
# Writing token files (shared by the corpus and the synthetic sets)
# ---------------------------------------------------------------------------------------------


def _token_dtype(vocab: int):
    if vocab <= 2**8:
        return np.uint8
    if vocab <= 2**16:
        return np.uint16
    return np.uint32


def tokens_sha256(train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(train).tobytes())
    h.update(np.ascontiguousarray(val).tobytes())
    return h.hexdigest()


def _write_token_file(out_path, train, val, attrs: dict,
                      extra_datasets: dict | None = None) -> Path:
    """Write ``out_path`` atomically: a uniquely named temp file in the same folder, then
    ``os.replace``. Several ranks may do this at once; readers only ever see a whole file."""
    import h5py

    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("train", data=train)
            f.create_dataset("val", data=val)
            for name, values in (extra_datasets or {}).items():
                f.create_dataset(name, data=np.array(values, dtype=object),
                                 dtype=h5py.string_dtype())
            now = datetime.datetime.now(datetime.timezone.utc)
            base = {
                "format_version": FORMAT_VERSION,
                "created": now.isoformat(timespec="seconds"),
                "sha256": tokens_sha256(train, val),
            }
            for key, value in {**base, **attrs}.items():
                f.attrs[key] = value
        with open(tmp, "rb+") as fh:  # make the bytes durable before the rename publishes them
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# The standard-library corpus
# ---------------------------------------------------------------------------------------------


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
    path = _write_token_file(out_path, train, val, attrs,
                             {"train_files": names["train"], "val_files": names["val"]})
    return {"path": str(path), **attrs, "n_train": int(train.size), "n_val": int(val.size),
            "unreadable_files": unreadable, "sha256": tokens_sha256(train, val),
            "uniform_loss": math.log(256)}


# ---------------------------------------------------------------------------------------------
# Synthetic sets
# ---------------------------------------------------------------------------------------------

SYNTHETIC_KINDS = ("pattern", "markov", "uniform")


def _synthetic_stream(kind: str, n: int, vocab: int, rng, noise: float, period: int):
    """(tokens, entropy rate in nats/token: the best loss any model can reach)."""
    if kind == "uniform":
        return rng.integers(0, vocab, size=n), math.log(vocab)
    if kind == "pattern":
        # A fixed sequence of `period` distinct tokens repeated; each position is replaced by a
        # uniformly random token with probability `noise`. A tiny model learns it in a few steps.
        period = min(period, vocab)
        pattern = rng.permutation(vocab)[:period]
        tokens = pattern[np.arange(n) % period]
        flip = rng.random(n) < noise
        tokens[flip] = rng.integers(0, vocab, size=int(flip.sum()))
        q, r = 1.0 - noise + noise / vocab, noise / vocab
        rate = -(q * math.log(q) + ((vocab - 1) * r * math.log(r) if r > 0 else 0.0))
        return tokens, rate
    if kind == "markov":
        # Each token has two successors, taken with probabilities 0.75 and 0.25.
        succ = np.stack([rng.permutation(vocab), rng.permutation(vocab)], axis=1)
        choice = (rng.random(n) >= 0.75).astype(np.int64)
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = rng.integers(vocab)
        for i in range(1, n):  # sequential by nature; n is small for test sets
            tokens[i] = succ[tokens[i - 1], choice[i]]
        return tokens, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    raise ValueError(f"unknown synthetic kind {kind!r}; choose one of {SYNTHETIC_KINDS}")


def prepare_synthetic(out_path, kind: str, n_tokens: int, vocab: int, seed: int, *,
                      val_fraction: float = 0.1, noise: float = 0.1, period: int = 16) -> dict:
    """Write a synthetic token set (same format as the corpus): ``kind`` is "pattern" (noisy
    repeating sequence), "markov" (two successors per token) or "uniform" (nothing to learn).
    The last ``val_fraction`` of the stream is ``val``. Attr ``entropy_rate`` is the best
    achievable loss (for "pattern": given the position in the period)."""
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; choose one of {SYNTHETIC_KINDS}")
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    n_val = int(round(n_tokens * val_fraction))
    if n_tokens - n_val < 2 or n_val < 2:
        raise ValueError(f"n_tokens={n_tokens} is too small for a train/val split; use at least "
                         f"{int(math.ceil(2 / min(val_fraction, 1 - val_fraction)))}")
    rng = np.random.default_rng([int(seed), vocab, SYNTHETIC_KINDS.index(kind)])
    tokens, rate = _synthetic_stream(kind, n_tokens, vocab, rng, noise, period)
    tokens = tokens.astype(_token_dtype(vocab))
    train, val = tokens[: n_tokens - n_val].copy(), tokens[n_tokens - n_val:].copy()
    attrs = {
        "vocab_size": int(vocab),
        "kind": f"synthetic:{kind}",
        "source": f"prepare_synthetic(kind={kind!r}, seed={seed}, noise={noise}, period={period})",
        "n_files": 0,
        "val_fraction": float(val_fraction),
        "entropy_rate": float(rate),
        "unigram_val_loss": unigram_entropy(val, vocab, train_tokens=train),
    }
    path = _write_token_file(out_path, train, val, attrs)
    return {"path": str(path), **attrs, "n_train": int(train.size), "n_val": int(val.size),
            "sha256": tokens_sha256(train, val), "uniform_loss": math.log(vocab)}


def _teacher(rng, d_in: int, d_out: int, hidden: int = 32):
    """A fixed random one-hidden-layer tanh network (the function students should learn)."""
    w1 = rng.normal(0.0, 1.0 / math.sqrt(d_in), size=(d_in, hidden))
    b1 = rng.normal(0.0, 0.1, size=hidden)
    w2 = rng.normal(0.0, 1.0 / math.sqrt(hidden), size=(hidden, d_out))
    return lambda x: np.tanh(x @ w1 + b1) @ w2


def synthetic_regression(n: int, d_in: int, d_out: int, seed: int, noise: float = 0.0):
    """(X, y) float64, X ~ N(0, 1) of shape (n, d_in), y = teacher(X) (+ Gaussian noise) of shape
    (n, d_out). The teacher depends on (seed, d_in, d_out) only, so more samples = more data from
    the same task."""
    teacher = _teacher(np.random.default_rng([int(seed), 1, d_in, d_out]), d_in, d_out)
    rng = np.random.default_rng([int(seed), 2])
    x = rng.normal(size=(n, d_in))
    y = teacher(x)
    if noise:
        y = y + rng.normal(0.0, noise, size=y.shape)
    return x, y


def synthetic_classification(n: int, d_in: int, n_classes: int, seed: int):
    """(X, y): X float64 (n, d_in), y int64 class labels (n,) = argmax of a fixed random teacher's
    logits, so 100% accuracy is reachable. (Labels are int64 indices, not floats, because
    cross-entropy indexes with them; ``np.eye(n_classes)[y]`` gives one-hot float64.)"""
    if n_classes < 2:
        raise ValueError(f"n_classes must be at least 2, got {n_classes}")
    teacher = _teacher(np.random.default_rng([int(seed), 3, d_in, n_classes]), d_in, n_classes)
    x = np.random.default_rng([int(seed), 4]).normal(size=(n, d_in))
    return x, np.argmax(teacher(x), axis=1).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _open_h5(path: Path):
    import h5py

    try:
        return h5py.File(path, "r", locking=False)  # no lock: many ranks, shared filesystems
    except (TypeError, ValueError):  # h5py / HDF5 too old for the locking argument
        return h5py.File(path, "r")


class TokenDataset:
    """A validated token file loaded into memory, and deterministic random batches from it."""

    def __init__(self, path):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"token file {self.path} does not exist; {FIX_HINT}")
        redo = f"recreate it with `mpipar prepare-data --out {self.path}`"
        try:
            f = _open_h5(self.path)
        except OSError as exc:
            raise DataError(f"{self.path} is not a readable HDF5 file (corrupt or truncated?): "
                            f"{exc}; {redo}") from None
        with f:
            attrs = dict(f.attrs)
            missing = [k for k in SPLITS if k not in f]
            if missing:
                raise DataError(f"{self.path} has no dataset(s) {missing} (found "
                                f"{sorted(f.keys())}); it is not an mpipar token file; {redo}")
            for key in ("vocab_size", "sha256"):
                if key not in attrs:
                    raise DataError(f"{self.path} lacks the attribute {key!r}; {redo}")
            version = int(attrs.get("format_version", 0))
            if version != FORMAT_VERSION:
                raise DataError(f"{self.path} has format_version {version}, this mpipar reads "
                                f"{FORMAT_VERSION}; {redo}")
            self.vocab_size = int(attrs["vocab_size"])
            self.tokens: dict[str, np.ndarray] = {}
            for split in SPLITS:
                ds = f[split]
                if ds.ndim != 1 or ds.dtype.kind != "u":
                    raise DataError(f"{self.path}: dataset {split!r} must be 1-D unsigned integer "
                                    f"tokens, found shape {ds.shape} dtype {ds.dtype}; {redo}")
                try:
                    self.tokens[split] = ds[()]
                except OSError as exc:
                    raise DataError(f"{self.path}: cannot read dataset {split!r} (truncated?): "
                                    f"{exc}; {redo}") from None
        self.attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}
        for split, arr in self.tokens.items():
            if arr.size < 2:
                raise DataError(f"{self.path}: split {split!r} has {arr.size} tokens, need at "
                                f"least 2; {redo}")
            top = int(arr.max())
            if top >= self.vocab_size:
                raise DataError(f"{self.path}: split {split!r} holds token {top}, outside the "
                                f"vocabulary of {self.vocab_size}; {redo}")
        digest = tokens_sha256(self.tokens["train"], self.tokens["val"])
        if digest != attrs["sha256"]:
            raise DataError(f"{self.path}: tokens do not match the stored sha256 (file modified or "
                            f"damaged); {redo}")
        self.sha256 = digest

    @property
    def unigram_val_loss(self) -> float:
        """The val loss of the best context-free model (nats/token), or NaN if not stored."""
        return float(self.attrs.get("unigram_val_loss", float("nan")))

    @property
    def kind(self) -> str:
        return str(self.attrs.get("kind", "?"))

    def __len__(self) -> int:
        return int(sum(a.size for a in self.tokens.values()))

    def split_len(self, split: str) -> int:
        return int(self._split(split).size)

    def _split(self, split: str) -> np.ndarray:
        if split not in self.tokens:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.tokens[split]

    def get_batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int):
        """(x, y), int64 arrays of shape (batch_size, seq_len), ``y[:, t] = x[:, t+1]`` in the
        stream. Random windows from ``default_rng([seed, step, split_id])``: the same on every
        rank; data parallelism takes its rows from the full batch."""
        data = self._split(split)
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if int(value) < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if seed < 0 or step < 0:
            raise ValueError(f"seed and step must be non-negative, got seed={seed} step={step}")
        if seq_len + 1 > data.size:
            raise DataError(f"seq_len {seq_len} needs {seq_len + 1} tokens but split {split!r} of "
                            f"{self.path} has {data.size}; use a shorter --seq-len or more data")
        rng = np.random.default_rng([int(seed), int(step), _SPLIT_ID[split]])
        starts = rng.integers(0, data.size - seq_len, size=batch_size)  # start + seq_len < size
        window = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])

    def describe(self) -> str:
        return (f"{self.path.name}: {self.kind}, vocab {self.vocab_size}, train "
                f"{self.split_len('train'):,} / val {self.split_len('val'):,} tokens, unigram val "
                f"loss {self.unigram_val_loss:.4f} (uniform {math.log(self.vocab_size):.4f})")


# ---------------------------------------------------------------------------------------------
# The default corpus
# ---------------------------------------------------------------------------------------------

CORPUS_NAME = "stdlib_corpus.h5"


def _repo_root() -> Path | None:
    """The source checkout holding this package, or None when installed elsewhere."""
    root = Path(__file__).resolve().parent.parent
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
