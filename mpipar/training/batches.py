"""Deterministic global batches for (seed, step), and this rank's share of them.

Every rank draws the same global batch, keeps its data-parallel replica's rows and cuts them into
micro-batches, so any grid sees exactly the rows the one-rank model sees.

An MLP's rows are read epoch by epoch, as a sampler over a fixed index does (PyTorch's
``DistributedSampler`` with shuffling, Megatron-LM's sample index): epoch ``e`` of a split is one
permutation of its rows from ``default_rng([seed, e, split])``, and step ``s`` takes positions
``s * batch .. (s + 1) * batch`` of the epochs laid end to end. So every row is seen once per
epoch, a step's rows depend on (seed, step) alone (a resume draws the same ones), and a step pays
a slice of a cached permutation: a seeded generator per step cost a small model's step several
per cent of its time.
"""

from __future__ import annotations

import numpy as np

from ..config import Config, ConfigError


class Batches:
    """Deterministic global batches for (seed, step), whatever the grid."""

    def __init__(self, cfg: Config, path=None):
        self.cfg = cfg
        m = cfg.model
        if m.kind == "gpt":
            self.ds = open_tokens(cfg, path)
        else:
            from ..datasets import synthetic_classification, synthetic_regression

            n = 4096
            if m.task == "classification":
                self.X, self.Y = synthetic_classification(n, m.sizes[0], m.sizes[-1],
                                                          cfg.train.seed)
            else:
                self.X, self.Y = synthetic_regression(n, m.sizes[0], m.sizes[-1], cfg.train.seed)
            # kept in the dtype they train in: an element's cast is the same before or after a
            # step's gather, and a float32 run then gathers half the bytes and converts none
            dtype = np.dtype(cfg.train.dtype)
            self.X = self.X.astype(dtype, copy=False)
            if m.task != "classification":
                self.Y = self.Y.astype(dtype, copy=False)
            cut = int(0.9 * n)
            self.split = {"train": (self.X[:cut], self.Y[:cut]),
                          "val": (self.X[cut:], self.Y[cut:])}
            self._epochs = {}  # split -> (epoch, its permutation): the one a step reads now
            self._views = {}  # (split, rows) -> the inputs' shape without their values

    def epoch_order(self, split, epoch):
        """The order in which epoch ``epoch`` of ``split`` reads its rows (cached: a run reads
        one epoch after another, so the last one made is the one asked for again)."""
        held = self._epochs.get(split)
        if held is None or held[0] != epoch:
            sid = 0 if split == "train" else 1
            order = np.random.default_rng([self.cfg.train.seed, epoch, sid]).permutation(
                len(self.split[split][0]))
            order.flags.writeable = False
            held = self._epochs[split] = (epoch, order)
        return held[1]

    def rows(self, split, step, batch_size):
        """The row indices of (split, step)'s global batch: positions ``step * batch_size``
        onwards of the split's epochs laid end to end (a batch may span two epochs, or more
        when it is larger than the split)."""
        n = len(self.split[split][0])
        start = step * batch_size
        epoch, offset = divmod(start, n)
        if offset + batch_size <= n:
            return self.epoch_order(split, epoch)[offset:offset + batch_size]
        pieces, left = [], batch_size
        while left:
            take = min(n - offset, left)
            pieces.append(self.epoch_order(split, epoch)[offset:offset + take])
            left, epoch, offset = left - take, epoch + 1, 0
        return np.concatenate(pieces)

    def get(self, split, step, batch_size, parts=1, part=0, inputs=True):
        """The global batch of (split, step); with ``parts`` > 1 only its row block ``part``
        (``split_rows``), the same rows: a data-parallel replica gathers its share alone.
        ``inputs=False`` (an MLP's pipeline rank without the first chunk, which never reads
        them): the inputs are not gathered, only their shape is kept (a read-only view of one
        row), the targets are the same rows as ever."""
        t = self.cfg.train
        if self.cfg.model.kind == "gpt":
            x, y = self.ds.get_batch(split, step, batch_size, t.seq_len, t.seed)
            return (x, y) if parts == 1 else (split_rows(x, parts, part),
                                              split_rows(y, parts, part))
        X, Y = self.split[split]
        rows = self.rows(split, step, batch_size)
        if parts > 1:
            rows = split_rows(rows, parts, part)
        if not inputs:  # the same rows, no 0.4 MB gather
            return self._shape_only(split, len(rows)), Y[rows]
        return X[rows], Y[rows]

    def _shape_only(self, split, n):
        """A read-only (n, features) view of one row of ``split``: the inputs' shape without
        their values, made once per row count (``broadcast_to`` costs a few microseconds a
        call, a pipeline rank's data step is a few tens)."""
        key = (split, n)
        view = self._views.get(key)
        if view is None:
            X = self.split[split][0]
            view = self._views[key] = np.broadcast_to(X[0], (n, X.shape[1]))
        return view


def open_tokens(cfg: Config, path):
    """The token file of a GPT run, read, verified and checked against model.vocab_size (no
    MPI traffic: the training loop opens it on every rank before the ranks agree). ``path``
    may be the opened ``TokenDataset`` already."""
    from ..datasets import TokenDataset

    ds = path if isinstance(path, TokenDataset) else TokenDataset(path)
    if ds.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data file {ds.path} has vocabulary {ds.vocab_size} but "
                          f"model.vocab_size = {cfg.model.vocab_size}: raise vocab_size (or "
                          f"prepare the file with a smaller --vocab)")
    return ds


def split_rows(a, parts, index=None):
    """``a`` cut into ``parts`` equal row blocks: all of them, or only block ``index``."""
    k = a.shape[0] // parts
    if index is not None:
        return a[index * k:(index + 1) * k]
    return [a[i * k:(i + 1) * k] for i in range(parts)]


def local_microbatches(run, backend, dp_rank: int, x, y, replica_rows=False):
    """This data-parallel replica's rows of a global batch, on the device, as the resolved
    run's (``resolved.ResolvedRun``) micro-batches. ``replica_rows``: x and y are this
    replica's rows already (``Batches.get(..., parts=dp, part=dp_rank)``)."""
    cfg = run.cfg
    dp = cfg.parallel.dp
    if not replica_rows:
        x, y = split_rows(x, dp, dp_rank), split_rows(y, dp, dp_rank)
    xp, dtype = backend.xp, backend.dtype
    if cfg.model.kind == "mlp":
        x = xp.asarray(x, dtype=dtype)
        if cfg.model.task == "regression":
            y = xp.asarray(y, dtype=dtype)
    else:
        x = xp.asarray(x)
    y = xp.asarray(y)
    m = run.microbatches
    return split_rows(x, m), split_rows(y, m)
