"""The watchdog: end the job when this rank makes no progress for ``run.watchdog_s`` seconds.

A daemon thread per rank reads ``mpipar.progress`` (the last beat and what it was) once in a
while. A rank stuck in a receive, a collective or a kernel stops beating; after the limit it
reports itself and what it is blocked in, and aborts the job through ``failfast`` (exit
``EXIT_STALLED``). The first step may be slower (warm-up, first allocations): it gets
``FIRST_STEP_FACTOR`` times the limit.
"""

from __future__ import annotations

import socket
import threading
import time

from mpipar import progress
from mpipar.mpi.job.failfast import EXIT_STALLED, SECONDARY_DELAY_S, fail

FIRST_STEP_FACTOR = 3
UNNAMED_DELAY_S = 1.5
# the hosts of every rank of this rank's groups ("world", "dp", "pp", "tp"), set once by the
# grid (``know_hosts``): a rank stalled in a collective names the hosts it spans
_GROUP_HOSTS: dict[str, list[str]] = {}
# the group a collective's beat runs over, by the words naming it (``training/steps.py``);
# any other all-reduce of the step (the gradient norm, the loss) is the world's
_GROUP_WORDS = (("data-parallel", "dp"), ("tensor-parallel", "tp"))


def know_hosts(groups: dict[str, list[str]]) -> None:
    """The host of each rank of this rank's groups, by group name ("world", "dp", ...)."""
    _GROUP_HOSTS.clear()
    _GROUP_HOSTS.update({g: list(h) for g, h in groups.items()})


class Watchdog:
    def __init__(self, limit_s: float, first_step: int = 0):
        self.limit_s = float(limit_s)
        self.first_step = first_step
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> Watchdog:
        if self.limit_s > 0:
            progress.beat("start of the training loop")
            self._thread = threading.Thread(target=self._run, name="mpipar-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def limit(self) -> float:
        s = progress.state
        first = s.step <= self.first_step
        # A rank waiting on a peer (a transfer, an all-reduce) is usually not the one that
        # stalled: it waits a little longer, so the culprit, idle longest, reports first.
        waiting = getattr(s.what, "is_comm", False) or "all-reduce" in str(s.what)
        # Of the waiting ranks, one that can name its peer (and that peer's host) speaks first:
        # a collective's rank knows only that someone in it is late.
        unnamed = waiting and not _peer(s)
        return (self.limit_s * (FIRST_STEP_FACTOR if first else 1)
                + (SECONDARY_DELAY_S if waiting else 0) + (UNNAMED_DELAY_S if unnamed else 0))

    def _run(self) -> None:
        poll = min(1.0, self.limit_s / 10)
        while not self._stop.wait(poll):
            s = progress.state
            idle = time.monotonic() - s.last
            if idle > self.limit() and not self._stop.is_set():
                fail(f"no progress for {idle:.0f} s (run.watchdog_s = {self.limit_s:g}):"
                     f" blocked in {_name(s.what)} of step {s.step}{_waiting_for(s)}"
                     f"{_spans(s)}",
                     code=EXIT_STALLED)


def _waiting_for(s) -> str:
    """", waiting for rank R (host H, ...), which stopped answering: <likely cause>" when the
    blocked action needs a peer's data. A peer on another host is named with the host (the
    lost node, or the far end of the link that went down); this host is named too, since only
    the ranks that can still reach the launcher get their message out."""
    peer = _peer(s)
    if not peer:
        return ""
    here = socket.gethostname()
    if f"(host {here}," in peer or f"(host {here})" in peer:
        why = "is it alive (stopped, swapping, stuck)?"
    else:
        why = f"node lost or link down between {here} and that host?"
    return f", waiting for {peer}, which stopped answering: {why}"


def _spans(s) -> str:
    """", over hosts A, B, which stopped: <likely cause>" for a rank stalled in an all-reduce:
    it cannot tell which member is late, but the hosts its group spans bound the search (a
    node lost, or the link between this host and the others)."""
    text = str(s.what)
    if hasattr(s.what, "is_comm") or "all-reduce" not in text:
        return ""
    group = next((g for words, g in _GROUP_WORDS if words in text), "world")
    hosts = list(dict.fromkeys(_GROUP_HOSTS.get(group, ())))
    if not hosts:
        return ""
    here = socket.gethostname()
    others = [h for h in hosts if h != here]
    if not others:
        return f", over host {here} only, which stopped: is a rank on it stuck?"
    return (f", over hosts {', '.join(hosts)}, which stopped: node lost or link down between "
            f"{here} and {', '.join(others)}?")


def _peer(s) -> str | None:
    """The rank (and host) a pipeline action waits for; None for anything else (an all-reduce
    waits for its whole group, not for the neighbouring stage)."""
    if s.peer_of is None or not hasattr(s.what, "is_comm"):
        return None
    try:
        return s.peer_of(s.what)
    except Exception:  # naming the peer must never hide the stall itself
        return None


def _name(what) -> str:
    return f"action {what}" if hasattr(what, "is_comm") else str(what)
