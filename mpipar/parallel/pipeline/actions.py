"""Pipeline schedules as data: an ordered list of actions per pipeline rank.

An action is ``OP<mb>.<chunk>``, e.g. ``F3.1`` is the forward of micro-batch 3 through global model
chunk 1 (chunks ``[0, pp*virtual_stages)`` in model order). Which rank holds a chunk is the
schedule's *placement*:

- ``loop`` (the default): chunk ``c`` lives on rank ``c % pp``; rank ``r`` holds chunks
  ``r, r+pp, r+2pp, ...`` (1F1B, interleaved, looped BFS);
- ``v`` (two chunks per rank): rank ``r`` holds chunks ``r`` and ``2pp-1-r``, so the first and
  the last chunk share rank 0 and chunks ``pp-1``, ``pp`` share the last rank (ZB-V, V-Half,
  DualPipeV). Neighbouring chunks on one rank pass data in memory, with no send or receive.

- ``F``: forward of the chunk. ``BW``: full backward (input and weight gradients).
- ``B``: input-gradient only, ``W``: weight-gradient only (zero-bubble split; W after B).
- ``SEND_F(mb, c)``: send the output of chunk c to the rank of chunk c+1.
  ``RECV_F(mb, c)``: receive the input of chunk c from the rank of chunk c-1.
- ``SEND_B(mb, c)``: send the input-gradient of chunk c to the rank of chunk c-1.
  ``RECV_B(mb, c)``: receive the output-gradient of chunk c from the rank of chunk c+1.
- ``UPDATE(mb, c)``: asynchronous PipeDream only: apply mb's gradient to chunk c's weights now
  (PipeDream-2BW: the gradient of mb's whole step, after the step's last micro-batch).

A *continuous* schedule (``steps=S`` in the header, S > 1) runs S training steps without a flush:
micro-batch ``j`` (``0 <= j < S * microbatches``) belongs to step ``j // microbatches``, and the
warm-up of step k+1 overlaps the cool-down of step k. ``vsync=true``: vertical sync (every stage
runs a micro-batch with the weight version the first stage used; ``versions.weight_versions``).
``lowered=true``: the lists are in the order the executor runs them (``lowering.lower``).

``F3.0&B1.7`` is a paired action (DualPipe's F&B): the forward of one micro-batch and the backward
of another, issued together (``Schedule.pairs``); here they run one after the other.

The text form (``Schedule.format`` / ``Schedule.parse``) is one header line and one line per rank::

    schedule kind=1f1b pp=2 virtual=1 microbatches=2 asynchronous=false placement=loop
    rank 0: F0.0 SEND_F0.0 F1.0 SEND_F1.0 RECV_B0.0 BW0.0 RECV_B1.0 BW1.0
    rank 1: RECV_F0.1 F0.1 BW0.1 SEND_B0.1 RECV_F1.1 F1.1 BW1.1 SEND_B1.1

Blank lines and ``#`` comments are ignored; a header without ``placement=`` means ``loop``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

OPS = ("F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UPDATE")
COMPUTE_OPS = ("F", "B", "W", "BW", "UPDATE")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

# Longest names first so that "BW0.0" is not read as "B" + garbage.
_TOKEN = re.compile(r"(SEND_F|SEND_B|RECV_F|RECV_B|UPDATE|BW|F|B|W)(\d+)\.(\d+)")


PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """A schedule that cannot be built, parsed or run; the message says what to change."""


def check_placement(placement: str, virtual_stages: int) -> None:
    if placement not in PLACEMENTS:
        raise ScheduleError(f"unknown placement {placement!r}; valid placements: "
                            f"{', '.join(PLACEMENTS)}")
    if placement == "v" and virtual_stages != 2:
        raise ScheduleError(f"placement v holds exactly two chunks per rank (rank r: chunks r "
                            f"and 2pp-1-r); got virtual_stages={virtual_stages}: use "
                            "virtual_stages=2 or placement loop")


def rank_of_chunk(chunk: int, pp: int, placement: str = "loop") -> int:
    """The rank that holds global chunk ``chunk`` under ``placement`` (see the module doc)."""
    if placement == "v":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def local_index(chunk: int, pp: int, placement: str = "loop") -> int:
    """Index of a global chunk among its rank's chunks, in model order (0 .. v-1)."""
    return chunk // pp  # loop: r, r+pp, ...; v: r then 2pp-1-r (both in model order)


@dataclass(frozen=True)
class Action:
    op: str
    mb: int
    chunk: int

    def __post_init__(self):
        if self.op not in OPS:
            raise ScheduleError(f"unknown op {self.op!r}; valid ops: {', '.join(OPS)}")
        if self.mb < 0 or self.chunk < 0:
            raise ScheduleError(f"negative micro-batch or chunk in {self.op}{self.mb}.{self.chunk}")

    def __str__(self) -> str:
        return f"{self.op}{self.mb}.{self.chunk}"

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS


def parse_action(token: str) -> Action:
    m = _TOKEN.fullmatch(token)
    if not m:
        raise ScheduleError(
            f"bad action {token!r}: expected OP<mb>.<chunk> with OP one of {', '.join(OPS)}"
        )
    return Action(m.group(1), int(m.group(2)), int(m.group(3)))


@dataclass
class Schedule:
    kind: str
    pp: int
    virtual_stages: int  # model chunks per rank (``virtual=`` in the text form)
    microbatches: int
    ranks: list[list[Action]] = field(default_factory=list)
    asynchronous: bool = False  # PipeDream: no flush, weight stashing, UPDATE actions
    placement: str = "loop"  # which rank holds which chunk: "loop" or "v" (module doc)
    # paired actions (DualPipe's F&B: a forward and a backward of other micro-batches issued as
    # one, overlapped on a GPU, run in sequence here): (rank, index of the F; the B follows)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    steps: int = 1  # training steps the lists span without a flush (continuous: > 1)
    vertical_sync: bool = False  # asynchronous only: every stage uses the first stage's version
    # the order the executor runs (``lowering.lower``): its sends are non-blocking, so the
    # deadlock check replays it with eager sends instead of rendezvous ones
    lowered: bool = False

    @property
    def total_microbatches(self) -> int:
        """Micro-batches in the lists: ``microbatches`` per step, ``steps`` steps."""
        return self.microbatches * self.steps

    def step_of(self, mb: int) -> int:
        """The step (0-based, within the lists) whose batch micro-batch ``mb`` comes from."""
        return mb // self.microbatches

    def updates_after(self, mb: int) -> bool:
        """Whether an asynchronous schedule has an UPDATE after micro-batch mb's backward:
        every one (PipeDream), or the last of each step (PipeDream-2BW)."""
        if self.kind == "pipedream-2bw":
            return mb % self.microbatches == self.microbatches - 1
        return True

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank that holds global chunk ``chunk``."""
        return rank_of_chunk(chunk, self.pp, self.placement)

    def local_chunk(self, chunk: int) -> int:
        """Index of a global chunk among its rank's chunks (0 .. virtual_stages-1)."""
        return local_index(chunk, self.pp, self.placement)

    def chunks_of(self, rank: int) -> list[int]:
        """The global chunks rank ``rank`` holds, in model order."""
        return [c for c in range(self.n_chunks) if self.rank_of(c) == rank]

    def header(self) -> str:
        return (
            f"schedule kind={self.kind} pp={self.pp} virtual={self.virtual_stages} "
            f"microbatches={self.microbatches} asynchronous={str(self.asynchronous).lower()} "
            f"placement={self.placement}"
            + (f" steps={self.steps}" if self.steps != 1 else "")
            + (" vsync=true" if self.vertical_sync else "")
            + (" lowered=true" if self.lowered else "")
        )

    def format(self) -> str:
        lines = [self.header()]
        paired = set(self.pairs)
        for r, acts in enumerate(self.ranks):
            words, i = [], 0
            while i < len(acts):
                if (r, i) in paired and i + 1 < len(acts):
                    words.append(f"{acts[i]}&{acts[i + 1]}")  # F&B: one paired action
                    i += 2
                else:
                    words.append(str(acts[i]))
                    i += 1
            lines.append(f"rank {r}: " + " ".join(words))
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.format()

    @staticmethod
    def parse(text: str) -> Schedule:
        header: dict[str, str] | None = None
        ranks: dict[int, list[Action]] = {}
        pairs: list[tuple[int, int]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].rstrip()
            if not line.strip():
                continue
            if header is None:
                header = _parse_header(line, lineno)
                continue
            r, acts, paired = _parse_rank_line(line, lineno, ranks)
            ranks[r] = acts
            pairs += [(r, i) for i in paired]
        if header is None:
            raise ScheduleError(
                "empty schedule: expected a header line such as "
                "'schedule kind=custom pp=2 virtual=1 microbatches=4'"
            )
        pp, v, m = header["pp"], header["virtual"], header["microbatches"]
        # the first absent rank only: a header may claim pp=99999999 in a few bytes
        first = next((r for r in range(pp) if r not in ranks), None)
        missing = [] if first is None else [first]
        extra = [r for r in ranks if r >= pp]
        if extra:
            raise ScheduleError(f"header says pp={pp} but the file has a line for rank {extra[0]}")
        if missing:
            raise ScheduleError(
                f"header says pp={pp} but there is no 'rank {missing[0]}:' line "
                "(write 'rank N:' with nothing after it for an idle rank)"
            )
        return Schedule(
            kind=header["kind"],
            pp=pp,
            virtual_stages=v,
            microbatches=m,
            ranks=[ranks[r] for r in range(pp)],
            asynchronous=header["asynchronous"],
            placement=header["placement"],
            pairs=sorted(pairs),
            steps=header["steps"],
            vertical_sync=header["vsync"],
            lowered=header["lowered"],
        )

    def save(self, path) -> None:
        Path(path).write_text(self.format())

    @staticmethod
    def load(path) -> Schedule:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ScheduleError(f"cannot read schedule file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ScheduleError(f"schedule file {path} is not text (byte at offset "
                                f"{exc.start}): pass a schedule written by `mpipar schedule "
                                f"--save`") from None
        try:
            return Schedule.parse(text)
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc}") from None


def _parse_header(line: str, lineno: int) -> dict:
    words = line.split()
    if words[0] != "schedule":
        raise ScheduleError(
            f"line {lineno}, column 1: expected the header "
            "'schedule kind=NAME pp=P virtual=V microbatches=M [asynchronous=false]', "
            f"got {words[0]!r}"
        )
    out: dict = {"kind": "custom", "virtual": 1, "asynchronous": False, "placement": "loop",
                 "steps": 1, "vsync": False, "lowered": False}
    col = len(words[0]) + 1
    for w in words[1:]:
        col = line.index(w, col) + 1
        key, eq, value = w.partition("=")
        where = f"line {lineno}, column {col}"
        if not eq:
            raise ScheduleError(f"{where}: expected key=value, got {w!r}")
        if key == "kind":
            out[key] = value
        elif key in ("pp", "virtual", "microbatches", "steps"):
            if not value.isdigit() or int(value) < 1:
                raise ScheduleError(f"{where}: {key} must be a positive integer, got {value!r}")
            out[key] = int(value)
        elif key in ("asynchronous", "vsync", "lowered"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ScheduleError(f"{where}: {key} must be true or false, got {value!r}")
            out[key] = value.lower() in ("true", "1")
        elif key == "placement":
            if value not in PLACEMENTS:
                raise ScheduleError(f"{where}: placement must be one of {', '.join(PLACEMENTS)}, "
                                    f"got {value!r}")
            out[key] = value
        else:
            raise ScheduleError(
                f"{where}: unknown header key {key!r} "
                "(known: kind, pp, virtual, microbatches, asynchronous, placement, steps, vsync, "
                "lowered)"
            )
        col += len(w)
    for key in ("pp", "microbatches"):
        if key not in out:
            raise ScheduleError(f"line {lineno}: the header needs {key}=N")
    try:
        check_placement(out["placement"], out["virtual"])
    except ScheduleError as exc:
        raise ScheduleError(f"line {lineno}: {exc}") from None
    return out


def _parse_rank_line(line: str, lineno: int, seen: dict) -> tuple[int, list[Action], list[int]]:
    m = re.match(r"\s*rank\s+(\d+)\s*:", line)
    if not m:
        raise ScheduleError(
            f"line {lineno}, column 1: expected 'rank N: ACTION ACTION ...', got {line.strip()!r}"
        )
    r = int(m.group(1))
    if r in seen:
        raise ScheduleError(f"line {lineno}: rank {r} appears twice")
    acts, paired = [], []
    for tok in re.finditer(r"\S+", line[m.end():]):
        col = m.end() + tok.start() + 1
        halves = tok.group().split("&")
        if len(halves) > 2:
            raise ScheduleError(f"line {lineno}, column {col}: a paired action joins two "
                                f"actions (F&B), got {tok.group()!r}")
        if len(halves) == 2:
            paired.append(len(acts))
        try:
            acts += [parse_action(h) for h in halves]
        except ScheduleError as exc:
            raise ScheduleError(f"line {lineno}, column {col}: {exc}") from None
    return r, acts, paired


def step_cuts(schedule: Schedule, actions: list[Action]) -> list[int]:
    """For each step k of a continuous schedule, the index in ``actions`` (one rank's list) just
    after the last action of a micro-batch of step k or earlier: the executor's call for step k
    runs the actions up to there."""
    last = [0] * schedule.steps
    for i, a in enumerate(actions):
        last[schedule.step_of(a.mb)] = i + 1
    for k in range(1, schedule.steps):  # a step with no action of its own on this rank
        last[k] = max(last[k], last[k - 1])
    return last


def matching(a: Action) -> Action:
    """The action a send or receive pairs with (on the rank of the neighbouring chunk)."""
    if a.op == "SEND_F":
        return Action("RECV_F", a.mb, a.chunk + 1)
    if a.op == "RECV_F":
        return Action("SEND_F", a.mb, a.chunk - 1)
    if a.op == "SEND_B":
        return Action("RECV_B", a.mb, a.chunk - 1)
    if a.op == "RECV_B":
        return Action("SEND_B", a.mb, a.chunk + 1)
    raise ScheduleError(f"{a} is not a send or a receive")


def _remote(c: int, other: int, rank_of) -> bool:
    return rank_of is None or rank_of(c) != rank_of(other)


def recvs_before(a: Action, n_chunks: int, rank_of=None) -> list[Action]:
    """Receives a compute action needs first when neighbouring chunks are on other ranks.

    ``rank_of(chunk) -> rank``: the placement; a neighbour on the same rank needs no receive
    (None: every neighbour is remote)."""
    if a.op == "F" and a.chunk > 0 and _remote(a.chunk, a.chunk - 1, rank_of):
        return [Action("RECV_F", a.mb, a.chunk)]
    if a.op in ("B", "BW") and a.chunk < n_chunks - 1 and _remote(a.chunk, a.chunk + 1, rank_of):
        return [Action("RECV_B", a.mb, a.chunk)]
    return []


def sends_after(a: Action, n_chunks: int, rank_of=None) -> list[Action]:
    """Sends that carry a compute action's result to the neighbouring chunk's rank."""
    if a.op == "F" and a.chunk < n_chunks - 1 and _remote(a.chunk, a.chunk + 1, rank_of):
        return [Action("SEND_F", a.mb, a.chunk)]
    if a.op in ("B", "BW") and a.chunk > 0 and _remote(a.chunk, a.chunk - 1, rank_of):
        return [Action("SEND_B", a.mb, a.chunk)]
    return []
