"""Bytes per link class (within a node, across nodes) per axis, from a dump's events and hosts.

A rank's host is the dump's ``hostnames`` entry. Point-to-point: each send's bytes, on the link
between the sender's host and its peer's (the receive is the same bytes: not counted twice).
Collectives (all-reduce, reduce-scatter, all-gather, broadcast, gather; their non-blocking
waits are not counted again): the payload each rank recorded, in the "across" column when the
rank's group on that axis (the ranks sharing its other coordinates; all ranks for ``world``)
sits on more than one host, else "within". That is the traffic of groups that use the slower
link, not a count of the bytes that crossed it: how many do depends on the algorithm (a
node-aware all-reduce sends about half of a flat one's; ``mpi/hierarchical.py``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .dump import Run, load

COLLECTIVE_OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "gather")
AXES = ("dp", "pp", "tp")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def hosts_of(run: Run) -> list | None:
    """Each rank's host, or None where the dump does not say."""
    hosts = run.attrs.get("hostnames")
    return list(hosts) if hosts and len(hosts) == run.world_size else None


def _spans(run: Run, hosts: list) -> dict:
    """{(axis, rank): whether rank's group on axis spans hosts}; "world": all ranks."""
    out = {}
    everyone = len(set(hosts)) > 1
    coords = [tuple(int(c) for c in run.coords[r]) for r in range(run.world_size)]
    for r in range(run.world_size):
        out[("world", r)] = everyone
        for k, axis in enumerate(AXES):
            key = tuple(c for i, c in enumerate(coords[r]) if i != k)
            group = [q for q in range(run.world_size)
                     if tuple(c for i, c in enumerate(coords[q]) if i != k) == key]
            out[(axis, r)] = len({hosts[q] for q in group}) > 1
    return out


def link_bytes(run: Run | str, steps=None) -> dict:
    """{axis: {"within": bytes, "across": bytes}} over the measured steps (all ranks); {} when
    the dump has no hosts."""
    if not isinstance(run, Run):
        run = load(run)
    hosts = hosts_of(run)
    if hosts is None:
        return {}
    steps = run.steps() if steps is None else list(steps)
    spans = []
    out = defaultdict(lambda: {"within": 0, "across": 0})
    for r in range(len(run.events)):
        for axis, got in rank_link_bytes(run, r, steps, hosts, spans).items():
            for where, nbytes in got.items():
                out[axis][where] += nbytes
    return dict(out)


def rank_link_bytes(run: Run, r: int, steps, hosts: list, spans: list) -> dict:
    """``_rank_links`` of rank r's events in ``steps`` (once per run and steps). ``spans``: a
    list holding the run's ``_spans`` once worked out (empty: not yet)."""
    from .fit_parts import cached

    def make(ev):
        if not spans:  # the groups' hosts: once per run, when a rank needs them
            spans.append(_spans(run, hosts))
        return _rank_links(run, r, ev[np.isin(ev["step"], steps)], hosts, spans[0])

    return cached(run, r, ("links", tuple(int(s) for s in steps)), make)


def _rank_links(run: Run, r: int, ev, hosts: list, spans: dict) -> dict:
    """{axis: {"within": bytes, "across": bytes}} of rank r's events ``ev``."""
    out = defaultdict(lambda: {"within": 0, "across": 0})
    for e in ev:
        axis, _, op = _text(e["kind"]).partition(".")
        op = op.rpartition(".")[2]  # tp sub-communicators: "tp.row.allreduce"
        nbytes, peer = int(e["bytes"]), int(e["peer"])
        if op == "send" and 0 <= peer < run.world_size:
            across = hosts[peer] != hosts[r]
        elif op in COLLECTIVE_OPS:
            across = spans.get((axis, r), spans[("world", r)])
        else:
            continue
        out[axis]["across" if across else "within"] += nbytes
    return {k: dict(v) for k, v in out.items()}


def links_text(path, steps=None) -> str:
    """The table ``mpipar analyze`` prints under a run on two or more hosts (else empty)."""
    run = load(path) if not isinstance(path, Run) else path
    hosts = hosts_of(run)
    if hosts is None or len(set(hosts)) < 2:
        return ""
    rows = link_bytes(run, steps)
    if not rows:
        return ""
    lines = [f"bytes per link class on {len(set(hosts))} hosts (all ranks, measured steps; "
             f"p2p by the hosts of sender and peer, collectives by whether the axis group "
             f"spans hosts):",
             f"  {'axis':<6} {'within MB':>11} {'across MB':>11} {'across':>7}"]
    order = [a for a in ("dp", "pp", "tp", "world") if a in rows] + sorted(
        a for a in rows if a not in ("dp", "pp", "tp", "world"))
    for axis in order:
        w, a = rows[axis]["within"], rows[axis]["across"]
        share = f"{a / (w + a):.0%}" if w + a else "-"
        lines.append(f"  {axis:<6} {w / 1e6:>11.3f} {a / 1e6:>11.3f} {share:>7}")
    return "\n".join(lines)
