"""Fit the simulator's ``CostModel`` from a dump's unit measurements (never from its step time).

What is fitted from what (medians/means over the measured steps; ``p`` = pipeline coordinate,
averaged over the dp and tp ranks that share it; tensor-parallel collectives nested in F/B stay
part of the unit):

- ``per_unit[(p, chunk, op)]``: mean F (+ LOSS on the last chunk), B (+ R, recomputation runs
  right before it), W durations; a ``BW`` action is recorded as one ``B`` event, so BW = B + R.
- ``overhead``: per action, the time between the first and last pipeline event of a rank's step
  not covered by any event (executor dispatch, bookkeeping), divided by its number of actions.
- ``send_post``: median ``pp.send`` (posting); ``recv_post``: median ``pp.recv`` (posting, done
  once per receive) plus the lower quartile of ``pp.wait`` (testing a message already there).
- ``latency``: per pair of neighbouring ranks, the two directions' minimum of receive wait end -
  send start, averaged (which cancels the ranks' clock offset); the median over pairs. Each
  receive's wait is told from a send's completion (both are ``pp.wait`` with the same mb, chunk
  and peer) by the windows the schedule allows (``_received``), and paired with its own send.
- ``dp_reduce[(p, chunk)]``: summed ``dp.*`` durations of the step (posts and waits).
- ``optimizer[p]``: ``OPT`` minus the collectives nested in it; ``sync``: the collectives nested
  in ``OPT`` plus the gap between a rank's last pipeline event and its ``OPT`` (less its dp
  waits there), the minimum over ranks (the last rank to arrive waits least); ``step_pre``: STEP
  start to the first event; ``step_post``: OPT end to STEP end, minimum over ranks.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np

from .dump import Run
from .fit_parts import (  # noqa: F401 (PIPE_KINDS re-exported)
    PART_NAMES,
    PIPE_KINDS,
    cached,
    chunks_of,
    rows_of,
    step_p2p,
    step_parts,
)
from .index import events_in, ranks_with_events
from .rank_steps import step_groups
from .units import (  # noqa: F401 (JITTER_POINTS, _mean re-exported)
    JITTER_POINTS,
    _mean,
    jitter,
    unit_costs,
)


def post_costs(ev) -> tuple[float, float]:
    """(send post, receive post) from a rank's events: the median ``pp.send``, and the median
    ``pp.recv`` plus the lower quartile of ``pp.wait`` (a wait that found its message there)."""
    dur, kinds = ev["end"] - ev["start"], ev["kind"]
    return _post_costs({"send": dur[kinds == "pp.send"], "recv": dur[kinds == "pp.recv"],
                        "wait": dur[kinds == "pp.wait"]})


def _post_costs(cols: dict) -> tuple[float, float]:
    """``post_costs`` from the durations of each kind (``_p2p_columns``)."""
    empty = np.empty(0)
    waits = cols.get("wait", empty)
    return (_med(cols.get("send", empty)),
            _med(cols.get("recv", empty)) + (_quartile(waits) if waits.size else 0.0))


def _quartile(values) -> float:
    """``np.percentile(values, 25)``'s value (linear, numpy's own two-sided interpolation, so
    the same bits); a short list without numpy's per-call cost (it ran once per step fit)."""
    if len(values) >= 64:
        return float(np.percentile(values, 25))
    s = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    at = (len(s) - 1) * 0.25
    lo = int(at)
    t = at - lo
    if t == 0.0:
        return float(s[lo])
    a, b = s[lo], s[lo + 1]
    return float(b - (b - a) * (1 - t)) if t >= 0.5 else float(a + (b - a) * t)


def _med(values, default=0.0) -> float:
    """``np.median``'s value; a short list without numpy's per-call cost."""
    if not len(values):
        return default
    if len(values) < 64:
        values = values.tolist() if isinstance(values, np.ndarray) else values
        s, n = sorted(values), len(values)
        return float(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)
    return float(np.median(values))


def _step_parts(run: Run, steps, n_actions: dict) -> dict:
    """name -> (world ranks, steps, values) of the step parts (module doc) over the ranks with
    events and ``steps`` (rank after rank, each in the order of ``steps``), each rank's steps
    worked out at once, once per run (``fit_parts.step_parts``): every replica's fit of every
    step asks. "dp_chunks" values: bit masks of the chunks (``fit_parts.chunks_of``)."""
    want = np.atleast_1d(np.asarray(steps, dtype=np.int64))
    cols = {k: ([], [], []) for k in PART_NAMES + ("dp_chunks",)}
    for r in ranks_with_events(run):
        n = n_actions.get(int(run.coords[r, 1]), 1)
        got = cached(run, r, ("step_parts", n), lambda ev, n=n: step_parts(ev, n))
        have = got["steps"]
        at = np.minimum(np.searchsorted(have, want), max(have.size - 1, 0))
        found = (have[at] == want) if have.size else np.zeros(want.size, bool)
        at, s = at[found], want[found]
        for name, (rs, ss, vs) in cols.items():
            v = got[name][at]
            keep = ~np.isnan(v) if v.dtype.kind == "f" else np.ones(v.size, bool)
            rs.append(np.full(int(keep.sum()), r))
            ss.append(s[keep])
            vs.append(v[keep])
    return {k: tuple(np.concatenate(c) if c else np.empty(0) for c in cols[k]) for k in cols}


def _p2p_columns(run: Run, steps) -> dict:
    """{"send", "recv", "wait": durations; "bytes": send payloads} of the ranks with events in
    ``steps``, rank after rank (what ``post_costs`` and ``default_bytes`` take medians of)."""
    cols = defaultdict(list)
    for r in ranks_with_events(run):
        got = cached(run, r, "p2p", step_p2p)
        for name, (at, vals) in got.items():
            cols[name].append(vals[rows_of(at, steps)])
    return {k: np.concatenate(v) for k, v in cols.items()}


def _uncovered(starts, ends) -> float:
    """Time between min(starts) and max(ends) that no interval covers."""
    if not len(starts):
        return 0.0
    order = np.argsort(starts)
    gap, reach = 0.0, float(starts[order[0]])
    for i in order:
        s, e = float(starts[i]), float(ends[i])
        if s > reach:
            gap += s - reach
        reach = max(reach, e)
    return gap


# the p2p latency is a minimum over matched messages (``transfer_times``), a Python walk of each
# rank's step: beyond this many (rank, step) pairs of the run, an even sample of its steps
LATENCY_RANK_STEPS = 8192


def latency_steps(run: Run, steps) -> list:
    """The steps ``transfer_times`` walks: all, or an even sample (``LATENCY_RANK_STEPS``)."""
    from .steps import even_sample

    steps = sorted(int(s) for s in np.atleast_1d(steps))
    return even_sample(steps, max(2, LATENCY_RANK_STEPS // max(run.world_size, 1)))


def fit(run: Run, steps, schedule, skip=()) -> tuple:
    """(``CostModel``, notes) for ``schedule`` (the run's, as data) from the dump's events.
    ``skip``: attributes the caller sets itself ("latency", "jitter"): not fitted (left 0 / ())."""
    from mpipar.parallel.pipeline.simulate import CostModel

    n_actions = {p: len(acts) for p, acts in enumerate(schedule.ranks)}
    parts = _step_parts(run, steps, n_actions)  # name -> [(world rank, step, value)]
    model = CostModel(per_unit=unit_costs(run, steps, schedule), unit={},
                      jitter=() if "jitter" in skip else jitter(run, steps, schedule))
    model.overhead = _med(parts["overhead"][2])
    cols = _p2p_columns(run, steps)
    model.send_post, model.recv_post = _post_costs(cols)
    timed = latency_steps(run, steps)
    lat = [] if "latency" in skip else transfer_times(run, timed, schedule)
    model.latency = _med(lat)
    sent = cols.get("bytes", np.empty(0))
    model.default_bytes = float(np.median(sent)) if sent.size else 0.0
    model.dp_reduce = _per_pp_chunk(run, parts["dp"], parts["dp_chunks"], schedule)
    model.optimizer = _per_pp(run, parts["optimizer"])
    model.sync = _min_over_ranks(parts["sync"])
    model.step_post = _min_over_ranks(parts["step_post"])
    model.step_pre = _med(parts["step_pre"][2])
    notes = [] if lat or schedule.pp == 1 or "latency" in skip else [
        "no messages both ways between two ranks to time: p2p latency 0"]
    if len(timed) < len(steps) and "latency" not in skip:
        notes.append(f"p2p latency from {len(timed)} of the {len(steps)} steps, spread evenly "
                     f"(at most {LATENCY_RANK_STEPS} rank x step pairs)")
    return model, notes


def _computes(ev: np.ndarray) -> tuple[dict, dict]:
    """({(mb, chunk): (F start, F end)}, {(mb, chunk): start of its backward (R or B)})."""
    fwd, bwd = {}, {}
    k = ev["kind"]
    e = ev[(k == "F") | (k == "B") | (k == "R")]
    for kind, mb, c, t0, t1 in _columns(e, "kind", "mb", "chunk", "start", "end"):
        if kind == "F":
            fwd.setdefault((mb, c), (t0, t1))
        else:
            bwd[(mb, c)] = min(bwd.get((mb, c), math.inf), t0)
    return fwd, bwd


def _columns(ev: np.ndarray, *names):
    """Rows of ``ev`` as tuples of Python values of ``names`` (a numpy row per access is slow)."""
    return zip(*(ev[n].tolist() for n in names), strict=True)


def _world_ranks(coords) -> dict:
    """{(dp, pp, tp): world rank}."""
    return {tuple(int(v) for v in c): w for w, c in enumerate(coords)}


def _requests(ev: np.ndarray, r: int, schedule, coords, world=None, recvs=None) -> dict:
    """{(mb, chunk, peer): [(lo, hi, (sender chunk, send op) or None)]}: every message request of
    world rank r in one step, keyed as its ``pp.wait`` is, with the window that wait must lie in.

    A send (its ``pp.send`` post; sender chunk None) completes after it was posted. RECV_F(mb, c)
    (from chunk c - 1) completes before F(mb, c) starts; RECV_B(mb, c) (from chunk c + 1) after
    F(mb, c) ends (its sender needed that activation) and before the backward of (mb, c) starts.
    ``recvs``: ``_receives`` of rank r, when the caller has it (one list for all its steps).
    """
    fwd, bwd = _computes(ev)
    out = defaultdict(list)
    for mb, c, peer, t0 in _columns(ev[ev["kind"] == "pp.send"], "mb", "chunk", "peer", "start"):
        out[(mb, c, peer)].append((t0, math.inf, None))
    for mb, c, forward, src, peer in recvs or _receives(r, schedule, coords, world):
        f0, f1 = fwd.get((mb, c), (math.inf, -math.inf))
        lo, hi = (-math.inf, f0) if forward else (f1, bwd.get((mb, c), math.inf))
        out[(mb, c, peer)].append((lo, hi, src))
    return out


def _receives(r: int, schedule, coords, world=None) -> list:
    """(mb, chunk, is RECV_F, (sender chunk, send op), sender's world rank) of every receive
    of world rank r's schedule, in order."""
    dp, p, tp = (int(v) for v in coords[r])
    world = _world_ranks(coords) if world is None else world
    out = []
    for a in schedule.ranks[p]:
        if a.op not in ("RECV_F", "RECV_B"):
            continue
        src = (a.chunk - 1, "SEND_F") if a.op == "RECV_F" else (a.chunk + 1, "SEND_B")
        out.append((a.mb, a.chunk, a.op == "RECV_F", src,
                    world.get((dp, schedule.rank_of(src[0]), tp))))
    return out


# a wait shorter than this found its message there already: its end bounds the latency from
# above only (a continuous run at m = 1 sends F(k + 1) a whole step before the peer waits)
WAITED = 20e-6


def _received(ev: np.ndarray, r: int, schedule, coords, world=None, recvs=None) -> list[tuple]:
    """(wait end, peer, mb, sender chunk, send op) of the receive waits of world rank r in one
    step that waited (``WAITED``).

    A ``pp.wait`` carries (mb, chunk, peer) but not whether it completed a send or a receive, and
    a rank's send of F(mb, c) and its receive of the gradient of (mb, c) share all three (the
    send's completion, found by a ``test`` between actions, can land just before the receive's
    wait). So each request is matched to a wait of its key inside its window (``_requests``), in
    every way the windows allow; a receive is kept only when all of them give it the same wait
    (pairing by order took a send's completion for a receive: latencies below zero)."""
    waits = defaultdict(list)
    for mb, c, peer, t0, t1 in _columns(ev[ev["kind"] == "pp.wait"], "mb", "chunk", "peer",
                                        "start", "end"):
        waits[(mb, c, peer)].append((t0, t1))
    out = []
    for key, reqs in _requests(ev, r, schedule, coords, world, recvs).items():
        got = waits.get(key, [])
        if len(got) != len(reqs) or len(reqs) > 4:
            continue  # not every request recorded (or more than one step's worth): skip
        chosen = defaultdict(set)  # request index -> waits it gets in some feasible matching
        for perm in itertools.permutations(range(len(got))):
            if all(lo <= got[w][0] and got[w][1] <= hi
                   for (lo, hi, _), w in zip(reqs, perm, strict=True)):
                for i, w in enumerate(perm):
                    chosen[i].add(w)
        for i, (_, _, src) in enumerate(reqs):
            if src is not None and len(chosen[i]) == 1:
                w0, w1 = got[chosen[i].pop()]
                if w1 - w0 >= WAITED:
                    out.append((w1, key[2], key[0], *src))
    return out


def _send_starts(run: Run, steps, schedule) -> dict:
    """{(step, sender, receiver, mb, sender chunk, op): send start}. A ``pp.send`` carries no
    direction, and at pp = 2 with v > 1 a chunk sends both its activation and its gradient of
    one micro-batch to the same peer: of two such sends SEND_F is the earlier (the gradient
    needs the activation to have gone through the chunks after it first)."""
    from mpipar.parallel.pipeline.actions import Action

    out = {}
    for r in ranks_with_events(run):
        e = events_in(run, r, steps)
        e = np.sort(e[e["kind"] == "pp.send"], order="start")
        if not e.size:
            continue
        p = int(run.coords[r, 1])
        acts = set(schedule.ranks[p])
        directions = {}  # (peer's stage, mb, chunk) -> the send ops that go there
        groups = defaultdict(list)
        for s, peer, mb, c, t0 in _columns(e, "step", "peer", "mb", "chunk", "start"):
            groups[(s, peer, mb, c)].append(t0)
        for (s, peer, mb, c), starts in groups.items():
            key = (int(run.coords[peer, 1]), mb, c)
            ops = directions.get(key)
            if ops is None:
                ops = directions[key] = [
                    op for op, dst in (("SEND_F", c + 1), ("SEND_B", c - 1))
                    if Action(op, mb, c) in acts and schedule.rank_of(dst) == key[0]]
            if len(ops) == len(starts):
                for op, t in zip(ops, starts, strict=True):
                    out[(s, r, peer, mb, c, op)] = t
    return out


def one_way_minima(run: Run, steps, schedule) -> dict:
    """{(sender, receiver): min(receive wait end on the receiver - send start on the sender)}
    over the receives that waited (``_received``), each matched to its own send by (step,
    sender, receiver, micro-batch, sender chunk, direction) (``_send_starts``). Each is
    latency + the receiver's clock offset - the sender's, or more."""
    sends = _send_starts(run, steps, schedule)
    best = {}
    got = run.cache.get("world_ranks")  # one map per run (its replicas share the coords)
    if got is None or got[0] is not run.coords:
        got = run.cache["world_ranks"] = (run.coords, _world_ranks(run.coords))
    world = got[1]
    for r in ranks_with_events(run):
        e = events_in(run, r, steps)
        found, g, _ = step_groups(e)
        order = np.argsort(g, kind="stable")  # each step's events, in recording order
        cut = np.searchsorted(g[order], np.arange(1, found.size))
        recvs = _receives(r, schedule, run.coords, world)  # the schedule's part: once a rank
        for s, rows in zip(found.tolist(), np.split(order, cut), strict=True):
            for end, peer, mb, chunk, op in _received(e[rows], r, schedule, run.coords, world,
                                                      recvs):
                t = sends.get((s, peer, r, mb, chunk, op))
                if t is not None:
                    best[(peer, r)] = min(best.get((peer, r), math.inf), end - t)
    return best


def transfer_times(run: Run, steps, schedule) -> list[float]:
    """p2p latency per pair of neighbouring ranks, immune to their clock offset.

    For messages a -> b, min(receive wait end on b - send start on a) is latency + offset(b) -
    offset(a) (a receive cannot end before its message arrived; the minimum is reached by one
    that waited for it); the two directions averaged cancel the offset (ranks take t0 after a
    barrier, but under load they leave it milliseconds apart) (``one_way_minima``)."""
    best = one_way_minima(run, steps, schedule)
    return [max(0.0, (d + best[(b, a)]) / 2) for (a, b), d in best.items()
            if a < b and (b, a) in best]


def _per_pp(run, rows) -> dict:
    """{p: mean of the values of the ranks at pipeline coordinate p} (rows in their order)."""
    ranks, _, vals = rows
    of_p = run.coords[ranks.astype(np.intp), 1] if ranks.size else np.empty(0, int)
    return {int(p): float(np.mean(vals[of_p == p])) for p in _first_seen(of_p)}


def _first_seen(values) -> list:
    """The distinct values in the order they first appear."""
    if not len(values):
        return []
    uniq, first = np.unique(values, return_index=True)
    return uniq[np.argsort(first)].tolist()


def _per_pp_chunk(run, rows, chunk_rows, schedule) -> dict:
    """dp time of each pipeline coordinate, split evenly over the chunks that reduce."""
    totals = _per_pp(run, rows)
    ranks, _, masks = chunk_rows
    of_p = run.coords[ranks.astype(np.intp), 1] if ranks.size else np.empty(0, int)
    out = {}
    for p, total in totals.items():
        if total <= 0:
            continue
        # dp events carry no chunk: every chunk this rank holds reduces its share
        held = chunks_of(np.bitwise_or.reduce(masks[of_p == p].astype(np.int64))
                         if (of_p == p).any() else 0)
        held = held or sorted({a.chunk for a in schedule.ranks[p]})
        for c in held:
            out[(p, c)] = total / len(held)
    return out


def _min_over_ranks(rows) -> float:
    """Median over steps of the minimum over ranks (the last rank to arrive waits least)."""
    _, steps, vals = rows
    if not len(vals):
        return _med([])
    uniq, inv = np.unique(steps, return_inverse=True)
    low = np.full(uniq.size, np.inf)
    np.minimum.at(low, inv.reshape(-1), vals)
    return _med(low)
