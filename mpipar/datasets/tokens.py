"""Token files: the format, writing them atomically, checksums, the unigram baseline, the reader.

File format (HDF5, ``format_version`` 1), see data/README.md:

- datasets ``train`` and ``val``: 1-D unsigned integer tokens (``uint8`` for vocabularies up to 256)
- attrs ``vocab_size``, ``kind`` ("bytes" or "synthetic:<kind>"), ``source``, ``n_files``,
  ``created`` (ISO 8601), ``format_version``, ``sha256`` (of ``train`` bytes then ``val`` bytes),
  ``unigram_val_loss`` (nats/token: val under add-one smoothed train unigram counts)

Batches are a pure function of (seed, split, step): every rank draws the same full batch and
the data-parallel caller takes its rows, so any grid sees the same data (docs/architecture.md,
"Same function, any grid").
"""

from __future__ import annotations

import datetime
import hashlib
import math
from pathlib import Path

import numpy as np

from ..files import atomic_h5, write_error

FORMAT_VERSION = 1
SPLITS = ("train", "val")
_SPLIT_ID = {"train": 0, "val": 1}
FIX_HINT = "run `mpipar prepare-data` (or pass --data PATH to an existing token file)"


class DataError(ValueError):
    """A token file exists but is not usable; the message names what is wrong and the fix."""


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


def token_dtype(vocab: int):
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


def write_token_file(out_path, train, val, attrs: dict,
                     extra_datasets: dict | None = None) -> Path:
    """Write ``out_path`` atomically (``files.atomic_h5``: a uniquely named temp file in the same
    folder, fsynced, then renamed). Several ranks may do this at once; readers only ever see a
    whole file."""
    import h5py

    out = Path(out_path).expanduser()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(out, exc) from None
    with atomic_h5(out, durable=True, in_memory=True) as f:
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
    return out


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
        if self.path.is_dir():
            raise DataError(f"token file {self.path} is a folder: pass the .h5 file that "
                            f"`mpipar prepare-data --out FILE` wrote to --data / data.path")
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
