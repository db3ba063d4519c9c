"""Many timed replays of one schedule at once: the simulator's arithmetic on arrays.

The calibrated prediction (``predict.calibrated``) simulates every measured step of every
pipeline under many jitter draws: 200 steps x 4 pipelines x 9 replays of a 32-action schedule
took 7,000 Python replays (most of the analysis of the README's job). The order in which a
replay runs the actions does not depend on the costs: a receive can run once its send has run
(``simulate._Timed.can_run``), whatever the times. So the order is found once
(``Compiled``) and every replay is the same few array operations per action, one array element
per (cost model, draw): the same additions, maxima and sums as ``simulate.simulate``, in the
same order, so each element equals what that replay gives (tests/test_analysis_scale.py
compares them).

Only what the prediction reads comes out (``Batch``): per rank its compute, its p2p and dp time,
its per-action overhead and the end of its pipeline with its dp reductions; and the first
compute start and last compute end (the pipeline window). Timelines, activations and charts
stay with ``simulate.simulate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..parallel.pipeline.actions import Schedule, matching
from ..parallel.pipeline.replay import Replay


class _Order(Replay):
    """A replay that only records which action runs when (``can_run`` as ``_Timed``'s)."""

    def __init__(self, s: Schedule):
        super().__init__(s.ranks)
        self.sent, self.order = set(), []

    def can_run(self, r, a) -> bool:
        return not a.op.startswith("RECV") or matching(a) in self.sent

    def run(self, r, a) -> None:
        if a.op.startswith("SEND"):
            self.sent.add(a)
        self.order.append((r, self.pos[r] - 1, a))


@dataclass
class Compiled:
    """A schedule's replay order: (rank, index in its list, action), as ``_Timed`` runs them."""

    schedule: Schedule
    order: list

    @classmethod
    def of(cls, s: Schedule) -> Compiled:
        rec = _Order(s)
        rec.play()
        return cls(s, rec.order)


@dataclass
class Batch:
    """Per replay (rows) and pipeline rank (columns), as ``SimResult`` names them."""

    busy: np.ndarray
    pipe_comm: np.ndarray
    overhead: np.ndarray
    pipeline_end: np.ndarray
    first_compute: np.ndarray  # per replay: earliest compute start (inf: none)
    last_compute: np.ndarray  # per replay: latest compute end (-inf: none)


def scales(s: Schedule, jitter: tuple, draw) -> list[np.ndarray]:
    """The multiplier of every action of every rank under ``draw``, drawn as ``_Timed`` does."""
    rng = np.random.default_rng(draw)
    pool = np.asarray(jitter, dtype=float)
    return [pool[rng.integers(0, len(pool), len(acts))] for acts in s.ranks]


class _Columns:
    """Per-replay values of a model attribute or cost, each distinct model asked once (a step's
    draws share their model)."""

    def __init__(self, models):
        ids = {}
        self.unique = [ids.setdefault(id(m), m) for m in models if id(m) not in ids]
        where = {id(m): k for k, m in enumerate(self.unique)}
        self.at = np.array([where[id(m)] for m in models], dtype=np.intp)

    def __call__(self, fn) -> np.ndarray:
        return np.asarray([fn(m) for m in self.unique], dtype=float)[self.at]


def evaluate(c: Compiled, models: list, draws: list) -> Batch:
    """One replay per (``models[i]``, ``draws[i]``): ``simulate(c.schedule, models[i],
    draw=draws[i])`` for each i, at once (draw None: each compute at its cost)."""
    s = c.schedule
    pp, v, n = s.pp, s.virtual_stages, len(models)
    col = _Columns(models)
    for m in col.unique:
        m.check()
    over = col(lambda m: m.overhead)
    send_post = col(lambda m: m.send_post)
    recv_post = col(lambda m: m.recv_post)
    now = [col(lambda m: m.step_pre) for _ in range(pp)]
    busy = [np.zeros(n) for _ in range(pp)]
    comm = [np.zeros(n) for _ in range(pp)]
    acc_over = [np.zeros(n) for _ in range(pp)]
    scale = _draw_table(s, models, draws)
    first, last = np.full(n, np.inf), np.full(n, -np.inf)
    sent, last_w = {}, {}
    for r, i, a in c.order:
        start = now[r]
        if a.op.startswith("SEND"):
            end = start + send_post
            sent[a] = end + col(lambda m, a=a: m.transfer(a))
            comm[r] = comm[r] + send_post
        elif a.op.startswith("RECV"):
            end = np.maximum(start, sent[matching(a)]) + recv_post
            comm[r] = comm[r] + (end - start)
        else:
            cost = col(lambda m, r=r, a=a: m.compute(r, a, v))
            if scale is not None:
                cost = cost * scale[r][:, i]
            end = start + cost
            busy[r] = busy[r] + (end - start)
            first, last = np.minimum(first, start), np.maximum(last, end)
            if a.op in ("W", "BW"):
                last_w[(r, a.chunk)] = end
        now[r] = end + over
        acc_over[r] = acc_over[r] + over
    ends = [_reductions(r, now[r], comm, last_w, col) for r in range(pp)]
    stack = lambda cols: np.stack(cols, axis=1) if cols else np.zeros((n, 0))  # noqa: E731
    return Batch(busy=stack(busy), pipe_comm=stack(comm), overhead=stack(acc_over),
                 pipeline_end=stack(ends), first_compute=first, last_compute=last)


def _draw_table(s: Schedule, models, draws):
    """Per rank, (replays x actions) multipliers, or None when no replay draws jitter. A
    replay that draws none gets 1.0 (x * 1.0 == x exactly). Draws repeat across replays
    (every step draws (k, dp)): each distinct one is drawn once."""
    if not any(d is not None and m.jitter for m, d in zip(models, draws, strict=True)):
        return None
    cache, rows = {}, []
    ones = [np.ones(len(acts)) for acts in s.ranks]
    for m, d in zip(models, draws, strict=True):
        if d is None or not m.jitter:
            rows.append(ones)
            continue
        key = (d, tuple(m.jitter))
        if key not in cache:
            cache[key] = scales(s, m.jitter, d)
        rows.append(cache[key])
    return [np.stack([row[r] for row in rows]) for r in range(s.pp)]


def _reductions(r, now_r, comm, last_w, col) -> np.ndarray:
    """``_Timed.reductions`` of rank r in every replay: its dp reductions one after another,
    each from its chunk's last weight pass (``dp_overlap``), in the order those passes end."""
    chunks = sorted({c for m in col.unique for (q, c) in m.dp_reduce if q == r})
    if not chunks:
        return now_r
    n = len(col.at)
    # a chunk a model does not reduce costs it 0: a span of length 0 moves no later start
    cost = np.stack([col(lambda m, ch=ch: m.dp_reduce.get((r, ch), 0.0)) for ch in chunks],
                    axis=1)
    overlap = col(lambda m: float(m.dp_overlap)) > 0
    lw = np.stack([last_w.get((r, ch), now_r) for ch in chunks], axis=1)
    order = np.argsort(lw, axis=1, kind="stable")  # sorted() is stable: ties by chunk
    rows = np.arange(n)
    prev, out = None, now_r
    for j in range(len(chunks)):
        col = order[:, j]
        ready = np.where(overlap, lw[rows, col], now_r)
        start = np.maximum(now_r if prev is None else prev, ready)
        prev = start + cost[rows, col]
        comm[r] = comm[r] + cost[rows, col]
        out = np.maximum(out, prev)
    return out
