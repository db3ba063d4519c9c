"""Ranks sharing a node's cores: a CPU spec (``cores_per_node``) and more ranks than cores.

Derived from the spec (cores per node, measured) and the run (ranks per node, known); nothing
here is fitted to a run:

- **time sharing** (``core_share``): MPI waits poll, so every rank holds a core all the time,
  waiting or not, and each gets ``cores / ranks`` of one, less by the spec's measured
  ``shared_slowdown`` (``plan.oversub``: processes sharing cores compute slower than their
  share): every CPU cost (units, optimizer, executor) is divided by that share. Links are not
  (what a transfer costs is not the polling rank's).
- **co-scheduling** (``cosched_wait``; shown beside a plan, not in it): a collective completes
  only while all its members are on a core together; point-to-point messages do not need that
  (they are buffered: a sender leaves, the receiver finds the data when it next runs). The
  scheduler runs a polling rank for its whole slice; a member that arrives while a partner is
  off its core therefore spins, on average, half a slice (``sched_slice``) before the partner
  gets one. With ``R`` ranks on ``C`` cores and a group of ``g``, the chance that all ``g - 1``
  partners run alongside a running member is ``C(R-g, C-g) / C(R-1, C-1)`` (the other ``C - 1``
  running ranks drawn from the other ``R - 1``); zero when ``g > C``. Each collective call of
  such a group costs ``(1 - that chance) x slice / 2`` on top of its link time. Not added:
  MPICH's waits yield, so a member that waits hands its core to a partner (or any other busy
  rank), and the time it waits is the others' share of the cores, which the time sharing has
  charged already. The dumps of the 8-block GPT on 4 ranks and 2 cores show it: a tp rank's own
  compute per step is 0.9-1.3 x the plan of it on a core of its own (the time sharing lands in
  its tp calls, about 1 ms each), a rank without tp computes 2.0-2.8 x as long (the sharing
  lands in its compute); with the wait added on top, the tp rows were planned 16-37 % long.
"""

from __future__ import annotations

import math
from pathlib import Path

from .cluster import Cluster

# EEVDF's base slice (Linux >= 6.6): 0.75 ms, scaled by 1 + log2(cpus) up to 8 cpus
BASE_SLICE_S = 0.75e-3
SLICE_FILES = ("/sys/kernel/debug/sched/base_slice_ns", "/proc/sys/kernel/sched_base_slice_ns",
               "/proc/sys/kernel/sched_min_granularity_ns")


def sched_slice(cores: int) -> float:
    """Seconds the scheduler runs a task before it may switch: the kernel's setting where it
    can be read, else EEVDF's default for ``cores`` cpus."""
    for name in SLICE_FILES:
        try:
            return int(Path(name).read_text().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            continue
    return BASE_SLICE_S * (1 + int(math.log2(max(1, min(cores, 8)))))


def core_share(c: Cluster, ranks_per_node: int, slowdown: bool = True) -> float:
    """The fraction of a core each rank gets (module doc), over the spec's measured
    ``shared_slowdown`` (``plan.oversub``; ``slowdown`` False: without it); 1 without
    ``cores_per_node``."""
    if c.cores_per_node <= 0 or ranks_per_node <= c.cores_per_node:
        return 1.0
    return c.cores_per_node / ranks_per_node / (c.shared_slowdown if slowdown else 1.0)


def cosched_wait(c: Cluster, ranks_per_node: int, group: int) -> float:
    """Expected seconds one collective call of a ``group``-rank group spins for its partners
    (module doc); 0 when the node has a core for every rank or the group is one rank."""
    cores, ranks = int(c.cores_per_node), int(ranks_per_node)
    if group <= 1 or cores <= 0 or ranks <= cores:
        return 0.0
    g = min(group, ranks)  # a group spanning nodes: its members on this node
    together = (math.comb(ranks - g, cores - g) / math.comb(ranks - 1, cores - 1)
                if g <= cores else 0.0)
    slice_s = dict(c.executor).get("sched_slice") or sched_slice(cores)
    return (1.0 - together) * slice_s / 2
