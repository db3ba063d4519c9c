"""``mpipar schedule``: build or load a pipeline schedule, lower it to the executor's order
(``lowering.lower``), check, simulate and chart that (no MPI): what is drawn is what runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

HELP = "show a pipeline schedule: timeline chart, bubble fraction, peak activations (no MPI)"


def add_arguments(p) -> None:
    p.add_argument(
        "--kind", help="naive, gpipe, 1f1b, interleaved, zb-h1, pipedream, zb-h2, zb-v, "
        "looped-bfs, v-half, v-min or dualpipev (default 1f1b)"
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches (default 8)")
    p.add_argument("--virtual-stages", "--virtual", "-v", dest="virtual_stages", type=int,
                   default=None, help="model chunks per rank (default 2 for interleaved, "
                   "looped-bfs and the V-shaped schedules, else 1); --virtual is the older name "
                   "of the same flag")
    p.add_argument("--file", help="load a schedule from this text file instead (see --actions); "
                   "a .csv file is read as torch.distributed.pipelining's schedule CSV")
    p.add_argument("--costs", default="",
                   help="cost model, e.g. F=1,B=1,W=1,BW=2,comm=0,UPDATE=0 (per stage)")
    p.add_argument("--steps", type=int, default=None,
                   help="pipedream / pipedream-2bw without a flush: the continuous schedule of "
                        "this many training steps (parallel.continuous)")
    p.add_argument("--vertical-sync", action="store_true",
                   help="pipedream: every stage uses the first stage's weight version")
    p.add_argument("--png", help="also write a Gantt chart to this PNG file")
    p.add_argument("--save", help="write the schedule's action lists to this text file (.csv: "
                   "torch.distributed.pipelining's CSV, with communication), as generated: "
                   "sends and receives in an order safe with blocking sends; mpipar lowers it "
                   "again when it runs or draws it")
    p.add_argument("--actions", action="store_true",
                   help="print the action lists too, in the executor's (lowered) order")
    p.add_argument("--width", type=int, default=120, help="chart width in characters")
    p.add_argument("--layout-from", metavar="DUMP",
                   help="print the layout string (--layout) that balances the per-unit compute "
                   "times measured in this timing dump over --pp x --virtual-stages stages")


# The largest schedule drawn: pp * microbatches * virtual_stages cells. Building, checking,
# simulating and charting cost about linear in the cells: 4096 (--pp 64 -m 64) takes seconds.
MAX_CELLS = 4096
MIN_WIDTH = 20  # characters: the rank labels and a few columns of chart


def parse_costs(text: str) -> dict:
    costs = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        try:
            if not eq or not key.strip():
                raise ValueError
            v = float(value)
        except ValueError:
            raise ValueError(
                f"bad --costs item {item!r}: write NAME=NUMBER, e.g. F=1,B=1,W=1"
            ) from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"--costs {key.strip()}={value.strip()}: a cost must be a finite "
                             f"number >= 0 (time units per stage), e.g. {key.strip()}=1")
        costs[key.strip()] = v
    return costs


def check_sizes(pp, microbatches, virtual_stages, width) -> None:
    """The command line's sizes, before any work: each >= 1 and the schedule small enough to
    draw in seconds (``MAX_CELLS``)."""
    for flag, n in (("--pp", pp), ("--microbatches/-m", microbatches),
                    ("--virtual-stages", virtual_stages)):
        if n is not None and n < 1:
            raise ValueError(f"{flag} = {n}: must be an integer >= 1")
    if width < MIN_WIDTH:
        raise ValueError(f"--width = {width}: the chart needs at least {MIN_WIDTH} characters")
    cells = pp * microbatches * (virtual_stages or 1)
    if cells > MAX_CELLS:
        raise ValueError(f"pp * microbatches * virtual_stages = {pp} * {microbatches} * "
                         f"{virtual_stages or 1} = {cells:,} cells is over the {MAX_CELLS:,} "
                         f"this command draws (the time grows with the cells): use smaller "
                         f"sizes, e.g. --pp 64 -m 64; the textbook bubble fraction it prints "
                         f"is (pp - 1) / (m + pp - 1) for 1F1B at any size")


def _layout_from(args) -> int:
    from mpipar.analysis.dump import DumpError, load
    from mpipar.analysis.stage_costs import suggest_layout

    try:
        text = suggest_layout(load(args.layout_from), args.pp * (args.virtual_stages or 1))
    except (DumpError, ValueError, OSError) as exc:
        print(f"mpipar schedule: error: {exc}", file=sys.stderr)
        return 2
    print(f"layout: {text}")
    return 0


def run(args) -> int:
    if args.layout_from:
        return _layout_from(args)
    from mpipar.parallel.pipeline.actions import Schedule, ScheduleError
    from mpipar.parallel.pipeline.chart import save_png, text_chart
    from mpipar.parallel.pipeline.check import check_schedule
    from mpipar.parallel.pipeline.generators import build_schedule, default_virtual_stages
    from mpipar.parallel.pipeline.lowering import lower
    from mpipar.parallel.pipeline.simulate import resolve_costs, simulate, textbook_bubble

    try:
        check_sizes(args.pp, args.microbatches, args.virtual_stages, args.width)
        costs = resolve_costs(parse_costs(args.costs))
        if args.file:
            if args.kind:
                raise ScheduleError("give either --file or --kind, not both")
            if args.file.endswith(".csv"):  # torch.distributed.pipelining's CSV
                from mpipar.parallel.pipeline.torch_csv import load_torch_csv

                source = load_torch_csv(args.file)
            else:
                source = Schedule.load(args.file)
            check_sizes(source.pp, source.microbatches, source.virtual_stages, args.width)
        else:
            kind = args.kind or "1f1b"
            virtual_stages = args.virtual_stages
            if virtual_stages is None:
                virtual_stages = default_virtual_stages(kind)
            source = build_schedule(kind, args.pp, args.microbatches, virtual_stages,
                                    steps=args.steps, vertical_sync=args.vertical_sync)
        s = lower(source)
        check_schedule(s)
        result = simulate(s, costs)
        if args.save and args.save.endswith(".csv"):  # torch's CSV, with sends and receives
            from mpipar.parallel.pipeline.torch_csv import format_torch_csv

            Path(args.save).write_text(format_torch_csv(source, "compute_comms"))
        elif args.save:
            source.save(args.save)
        if args.png:
            save_png(result, s, args.png)
    except (ValueError, OSError) as exc:  # user errors: a message, no traceback
        print(f"mpipar schedule: error: {exc}", file=sys.stderr)
        return 2

    if args.actions:
        print(s.format())
    print(text_chart(result, s, width=args.width))
    cost_text = ", ".join(f"{k}={v:g}" for k, v in costs.items())
    print(f"costs: {cost_text} (per stage; a chunk costs 1/virtual_stages of that)")
    print(f"makespan: {result.makespan:g}")
    print(f"bubble fraction (simulated): {result.bubble_fraction:.4f}   per rank: "
          + " ".join(f"{b:.3f}" for b in result.per_rank_bubble))
    _print_textbook(s, textbook_bubble)
    print("peak activations (micro-batch x chunk held, per rank): "
          + " ".join(str(x) for x in result.peak_activations))
    _print_published(s, result)
    if args.png:
        print(f"wrote {args.png}")
    if args.save:
        print(f"wrote {args.save}")
    return 0


def _print_textbook(s, textbook_bubble) -> None:
    tb = (textbook_bubble(s.kind, s.pp, s.microbatches, s.virtual_stages) if s.steps == 1
          else None)
    if tb is None:
        why = {
            "pipedream": "asynchronous, no flush: the bubble vanishes in the steady state",
            "zb-h1": "the published schedule assumes microbatches >= pp",
        }.get(s.kind, "no formula")
        if s.steps > 1:
            why = f"{s.steps} steps without a flush: warm-up and drain paid once"
        print(f"bubble fraction (textbook): n/a ({why})")
    else:
        note = " (assumes no comm time)"
        if s.kind == "zb-h1":
            note = " (assumes F = B = W, no comm time)"
        print(f"bubble fraction (textbook): {tb:.4f}{note}")


def _print_published(s, result) -> None:
    """The papers' figures for the 2023-2025 schedules (F = B = W), beside the simulated ones."""
    from mpipar.parallel.pipeline.formulas import peak_stage_activations, published, span_bubble

    pub = published(s.kind, s.pp, s.microbatches, s.virtual_stages)
    print(f"placement: {s.placement}; peak activations in whole-stage micro-batches: "
          f"{peak_stage_activations(result, s.virtual_stages):g}; span bubble (simulated, "
          f"1 - busy / longest rank span): {span_bubble(result):.4f}")
    if pub is not None:
        approx = "" if pub["exact"] else "~"
        sync = "n/a" if pub["sync"] is None else f"{pub['sync']:.4f}"
        print(f"published ({pub['source']}, F = B = W): span bubble {approx}{pub['span']:.4f}, "
              f"synchronous-step bubble {sync}, peak {approx}{pub['peak']:g}")
