"""Read and write ``torch.distributed.pipelining``'s schedule CSV (no torch needed here).

torch writes one row per rank, one cell per action, each action ``<stage><TYPE><microbatch>``:
``2F0`` forward of micro-batch 0 through stage 2, ``1B3`` full backward, ``1I3`` input-gradient
backward, ``1W3`` weight-gradient backward, ``0SEND_F1`` / ``1RECV_F1`` / ``1SEND_B1`` /
``0RECV_B1`` the messages (torch's SEND_F of stage s goes to stage s+1, its RECV_F on stage s
comes from stage s-1: mpipar's meaning too), an empty cell an idle slot. A torch stage is an
mpipar chunk; torch's ``B`` is mpipar's ``BW``, torch's ``I`` mpipar's ``B``.

Two forms, as torch's ``_dump_csv`` / ``_load_csv``: ``compute_only`` (mpipar then places the
sends and receives itself, as for its own generators) and ``compute_comms`` (kept as written,
then checked). torch's FSDP actions (UNSHARD, RESHARD, REDUCE_GRAD) have no meaning without FSDP
and are dropped. The placement (loop or V) is read from which stages each row holds.
"""

from __future__ import annotations

import csv
import io
import re

from .actions import Action, Schedule, ScheduleError, rank_of_chunk

FORMATS = ("compute_only", "compute_comms")
_TO_MPIPAR = {"F": "F", "B": "BW", "I": "B", "W": "W", "SEND_F": "SEND_F", "RECV_F": "RECV_F",
              "SEND_B": "SEND_B", "RECV_B": "RECV_B"}
_TO_TORCH = {v: k for k, v in _TO_MPIPAR.items()}
_IGNORED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_CELL = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|B|I|W)"
                   r"(\d*)")


def _parse_cell(cell: str, row: int, col: int):
    """An Action, a paired (F, B) tuple (torch's ``(0F3;3B1)OVERLAP_F_B``) or None (dropped)."""
    cell = cell.strip()
    if cell.startswith("(") and cell.endswith(")OVERLAP_F_B"):
        halves = [_parse_cell(h, row, col) for h in cell[1:-len(")OVERLAP_F_B")].split(";")]
        halves.sort(key=lambda a: a.op != "F")  # mpipar writes the forward first
        if len(halves) != 2 or halves[0].op != "F" or halves[1].op not in ("B", "BW"):
            raise ScheduleError(f"torch CSV row {row + 1}, column {col + 1}: {cell!r} must "
                                "pair one forward with one backward")
        return tuple(halves)
    m = _CELL.fullmatch(cell)
    if not m:
        raise ScheduleError(f"torch CSV row {row + 1}, column {col + 1}: cannot read action "
                            f"{cell!r}; expected <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B>"
                            "<microbatch>, e.g. 2F0")
    stage, kind, mb = m.groups()
    if kind in _IGNORED:
        return None
    if not mb:
        raise ScheduleError(f"torch CSV row {row + 1}, column {col + 1}: {cell!r} has no "
                            "micro-batch number")
    return Action(_TO_MPIPAR[kind], int(mb), int(stage))


def _flat(items) -> list[Action]:
    return [a for it in items for a in (it if isinstance(it, tuple) else (it,))]


def _placement(rows: list[list], pp: int) -> tuple[str, int]:
    rows = [_flat(items) for items in rows]
    chunks = {a.chunk for acts in rows for a in acts}
    n = max(chunks) + 1 if chunks else pp
    if n % pp:
        raise ScheduleError(f"torch CSV: {n} stages do not divide over {pp} ranks")
    for placement in ("loop", "v"):
        if placement == "v" and n != 2 * pp:
            continue
        if all(rank_of_chunk(a.chunk, pp, placement) == r
               for r, acts in enumerate(rows) for a in acts):
            return placement, n // pp
    raise ScheduleError("torch CSV: the stages on each row follow neither the loop placement "
                        "(stage s on rank s % pp) nor the V (rank r: stages r and 2pp-1-r)")


def parse_torch_csv(text: str, fmt: str | None = None, kind: str = "torch") -> Schedule:
    """A ``Schedule`` from torch's CSV text; ``fmt`` one of ``FORMATS`` (None: compute_comms
    when any send or receive is in it, else compute_only)."""
    from .generators import _place

    if fmt is None:
        fmt = "compute_comms" if re.search(r"\d(SEND|RECV)_", text) else "compute_only"
    if fmt not in FORMATS:
        raise ScheduleError(f"unknown torch CSV format {fmt!r}; use {' or '.join(FORMATS)}")
    rows = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        acts = [_parse_cell(c, r, i) for i, c in enumerate(row) if c.strip()]
        rows.append([a for a in acts if a is not None])
    if not rows:
        raise ScheduleError("torch CSV: no rows (one row per pipeline rank expected)")
    pp = len(rows)
    placement, v = _placement(rows, pp)
    m = 1 + max((a.mb for items in rows for a in _flat(items)), default=0)
    if fmt == "compute_only":
        comm = [a for items in rows for a in _flat(items) if a.is_comm]
        if comm:
            raise ScheduleError(f"torch CSV in compute_only form holds {comm[0]}; read it as "
                                "compute_comms")
        # a V's ranks feed two neighbours: let receivers take data early (generators.py)
        ranks, pairs = _place(pp, pp * v, rows, placement, early_receives=placement == "v")
    else:
        ranks, pairs = [], []
        for r, items in enumerate(rows):
            flat = []
            for it in items:
                if isinstance(it, tuple):
                    pairs.append((r, len(flat)))
                flat += _flat([it])
            ranks.append(flat)
    return Schedule(kind, pp, v, m, ranks, placement=placement, pairs=pairs)


def format_torch_csv(s: Schedule, fmt: str = "compute_only") -> str:
    """torch's CSV text of ``s`` (``compute_only`` drops the sends and receives)."""
    if fmt not in FORMATS:
        raise ScheduleError(f"unknown torch CSV format {fmt!r}; use {' or '.join(FORMATS)}")
    if s.asynchronous:
        raise ScheduleError("torch's CSV has no UPDATE action: asynchronous PipeDream cannot be "
                            "written in it")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    paired = set(s.pairs)
    for r, acts in enumerate(s.ranks):
        cells, i = [], 0
        while i < len(acts):
            if (r, i) in paired:  # F&B: torch's OVERLAP_F_B with the two as sub-actions
                cells.append(f"({_cell(acts[i])};{_cell(acts[i + 1])})OVERLAP_F_B")
                i += 2
                continue
            if fmt == "compute_comms" or acts[i].is_compute:
                cells.append(_cell(acts[i]))
            i += 1
        writer.writerow(cells)
    return out.getvalue()


def _cell(a: Action) -> str:
    return f"{a.chunk}{_TO_TORCH[a.op]}{a.mb}"


def load_torch_csv(path, fmt: str | None = None, kind: str | None = None) -> Schedule:
    from pathlib import Path

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ScheduleError(f"cannot read torch CSV {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ScheduleError(f"torch CSV {path} is not text (byte at offset {exc.start}): pass "
                            f"a schedule CSV exported by torch.distributed.pipelining") from None
    try:
        return parse_torch_csv(text, fmt, kind or f"torch:{Path(path).stem}")
    except ScheduleError as exc:
        raise ScheduleError(f"{path}: {exc}") from None
