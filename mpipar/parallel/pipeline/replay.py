"""The one "advance every rank until it is stuck" loop, shared by three clients.

``check._check_deadlock`` (rendezvous replay), ``simulate.simulate`` (timed replay) and
``generators._add_communication`` (placing sends and receives) all walk every rank's action list
in rounds, each rank going on while its next action can run, until all are done or none can move.
``Replay`` is that loop; a client subclasses it and fills in the hooks:

- ``can_run(r, a)``: whether action ``a``, next on rank ``r``, has what it needs now;
- ``run(r, a)``: what happens when it runs (after the rank's cursor moved past it);
- ``before_round()``: work done ahead of each round; True if it moved anything (then the round
  waits for the next pass, so that work always goes first);
- ``unstick()``: a last resort when nothing moved; True if it moved something;
- ``stuck()``: the exception to raise when nothing can move and some rank is not done;
- ``finish()``: called once every rank is done.

Ranks are visited in order 0..pp-1 in every round, so a replay is deterministic.
"""

from __future__ import annotations

from .actions import Action

# Default cost of each action kind, per pipeline stage (a chunk costs 1/virtual_stages of that):
# the simulator's default cost model and the estimate that orders messages in _add_communication.
UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0, "comm": 0.0, "UPDATE": 0.0}


class Replay:
    """Cursors over per-rank action lists, advanced in rounds by the hooks above."""

    greedy = True  # a rank runs every ready action per visit (False: at most one)

    def __init__(self, streams: list[list[Action]]):
        self.streams = streams
        self.pos = [0] * len(streams)

    # -- hooks
    def can_run(self, r: int, a: Action) -> bool:
        return True

    def run(self, r: int, a: Action) -> None:
        pass

    def before_round(self) -> bool:
        return False

    def unstick(self) -> bool:
        return False

    def stuck(self) -> Exception:
        blocked = "; ".join(f"rank {r} at {self.current(r)}" for r in self.unfinished())
        return RuntimeError(f"replay stuck: {blocked}")

    def finish(self) -> None:
        pass

    # -- cursors
    def done(self, r: int) -> bool:
        return self.pos[r] >= len(self.streams[r])

    def current(self, r: int) -> Action | None:
        return None if self.done(r) else self.streams[r][self.pos[r]]

    def unfinished(self) -> list[int]:
        return [r for r in range(len(self.streams)) if not self.done(r)]

    def step(self, r: int) -> None:
        """Run rank r's next action."""
        a = self.streams[r][self.pos[r]]
        self.pos[r] += 1
        self.run(r, a)

    # -- the loop
    def _round(self) -> bool:
        moved = False
        for r in range(len(self.streams)):
            while not self.done(r) and self.can_run(r, self.current(r)):
                self.step(r)
                moved = True
                if not self.greedy:
                    break
        return moved

    def play(self):
        """Advance until every rank is done (then ``finish()``) or none can move (raise)."""
        while True:
            if self.before_round() or self._round():
                continue
            if not self.unfinished():
                return self.finish()
            if not self.unstick():
                raise self.stuck()
