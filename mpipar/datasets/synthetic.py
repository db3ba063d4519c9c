"""Synthetic data: token sets with a known best loss (for GPT tests) and the MLP teacher tasks."""

from __future__ import annotations

import math

import numpy as np

from .tokens import token_dtype, tokens_sha256, unigram_entropy, write_token_file

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


# the largest synthetic vocabulary: uint32 tokens, and the generators' per-token tables (a
# permutation, counts) stay within a few hundred MB
MAX_VOCAB = 2**24


def prepare_synthetic(out_path, kind: str, n_tokens: int, vocab: int, seed: int, *,
                      val_fraction: float = 0.1, noise: float = 0.1, period: int = 16) -> dict:
    """Write a synthetic token set (same format as the corpus): ``kind`` is "pattern" (noisy
    repeating sequence), "markov" (two successors per token) or "uniform" (nothing to learn).
    The last ``val_fraction`` of the stream is ``val``. Attr ``entropy_rate`` is the best
    achievable loss (for "pattern": given the position in the period)."""
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; choose one of {SYNTHETIC_KINDS}")
    if not 2 <= vocab <= MAX_VOCAB:
        raise ValueError(f"--vocab {vocab}: a synthetic vocabulary must be from 2 to "
                         f"{MAX_VOCAB:,} (its tables take memory in proportion): pick a "
                         f"smaller one")
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
    tokens = tokens.astype(token_dtype(vocab))
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
    path = write_token_file(out_path, train, val, attrs)
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
