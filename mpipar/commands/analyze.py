"""``mpipar analyze``: tabulate timing dumps (per-rank breakdown, run summary, comparison).

Never imports MPI: only ``mpipar.analysis`` (h5py, numpy; matplotlib for --plots).
"""

from __future__ import annotations

import glob
import os
import re
import sys

HELP = "break down timing dumps (trace.h5) per rank and compare runs"


def add_arguments(parser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="RUN",
        help="a trace.h5, or a directory searched for **/trace.h5 (a sweep)",
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="analyse only this step (default: all steps, skipping warm-up step 0)",
    )
    parser.add_argument(
        "--steps",
        default=None,
        metavar="A:B",
        help="analyse only steps A to B-1 (a bound may be left out: 100: or :200); only their "
        "rows are read",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="analyse N steps spread evenly over the measured ones (first and last included); "
        "the output says which. For long runs: the analysis costs what the sample holds",
    )
    parser.add_argument(
        "--peak",
        type=float,
        default=None,
        metavar="FLOPS",
        help="peak FLOP/s of one device for MFU (default: the dump's peak_flops)",
    )
    parser.add_argument(
        "--plots",
        default=None,
        metavar="DIR",
        help="also write timeline, breakdown (and scaling) plots into DIR",
    )
    parser.add_argument("--plot-format", choices=("png", "svg"), default="png")
    parser.add_argument("--format", choices=("text", "csv", "json"), default="text")
    parser.add_argument(
        "--chrome-trace",
        default=None,
        metavar="FILE",
        help="write a Chrome Trace Event JSON (Perfetto, chrome://tracing): one track per rank "
        "for the measured step (--step, default the first measured one) and the simulator's "
        "prediction of it beside (unless --chrome-trace-predicted)",
    )
    parser.add_argument(
        "--spec",
        default=None,
        metavar="FILE",
        help="cluster spec for the planned column (mpipar plan measure --out FILE; default "
        "$MPIPAR_SPEC): step, bubble, per-rank compute, communication and memory from the spec "
        "alone, beside measured and calibrated",
    )
    parser.add_argument(
        "--chrome-trace-predicted",
        default=None,
        metavar="FILE",
        help="write the predicted run to this Chrome trace file instead",
    )


def expand(paths: list[str]) -> list[tuple[str, str]]:
    """(file, run name) for every input: files as given, directories globbed for **/trace.h5."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "**", "trace.h5"), recursive=True))
            if not found:
                raise FileNotFoundError(
                    f"{p}: directory holds no trace.h5 (searched {p}/**/trace.h5)"
                )
            for f in found:
                rel = os.path.relpath(os.path.dirname(f), p)
                name = os.path.basename(os.path.abspath(p)) if rel == "." else rel
                out.append((f, name))
        else:
            out.append((p, None))
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def check_arguments(args) -> None:
    """Refuse absurd flags before reading any dump (``ValueError`` saying what to change)."""
    import math

    if args.peak is not None and not (math.isfinite(args.peak) and args.peak > 0):
        raise ValueError(f"--peak = {args.peak}: the peak FLOP/s of one device must be a finite "
                         f"number > 0 (e.g. --peak 1e12), or leave it out to use the dump's")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step = {args.step}: steps count from 0; pass a step >= 0")
    step_choice(args)  # --steps / --sample / --step together: one clear error, before reading
    if args.plots:
        from mpipar.analysis.plots import check_plot_dir

        check_plot_dir(args.plots)
    from mpipar.files import check_writable

    for flag in ("chrome_trace", "chrome_trace_predicted"):  # at once, not after the analysis
        if getattr(args, flag):
            check_writable(getattr(args, flag), "the chrome trace", f"pass --"
                           f"{flag.replace('_', '-')} a file in a writable directory")


def step_choice(args):
    """The ``StepChoice`` of --step/--steps/--sample, or None when none is given (all rows)."""
    from mpipar.analysis.steps import StepChoice, parse_window

    window = parse_window(args.steps) if getattr(args, "steps", None) is not None else None
    sample = getattr(args, "sample", None)
    if window is None and sample is None:
        return None if args.step is None else StepChoice(step=args.step)
    return StepChoice(step=args.step, window=window, sample=sample)


def run(args) -> int:
    from mpipar.analysis import DumpError, breakdown, compare, load, report
    from mpipar.analysis.stream import load as load_streamed

    try:
        check_arguments(args)
        inputs = expand(args.paths)
        runs, seen = [], {}
        for path, name in inputs:
            # streamed (one rank's events at a time) unless plots or traces need the events
            whole = args.plots or args.chrome_trace or args.chrome_trace_predicted
            r = (load(path, name=name, steps=step_choice(args)) if whole else
                 load_streamed(path, name=name, steps=step_choice(args), step=args.step))
            # two runs of the same name (foo/trace.h5, bar/foo/trace.h5) get a numeric suffix
            n = seen.get(r.name, 0)
            seen[r.name] = n + 1
            if n:
                r.name = f"{r.name}#{n + 1}"
            runs.append(r)
        results = [breakdown(r, step=args.step, peak=args.peak) for r in runs]
        from mpipar.plan.here import attach_planned

        attach_planned(runs, results, args.spec)  # a bad spec: PlanError, a ValueError
    except (DumpError, FileNotFoundError, ValueError) as exc:
        print(f"mpipar analyze: error: {exc}", file=sys.stderr)
        return 2
    table = compare(results)
    writer = {"text": report.to_text, "csv": report.to_csv, "json": report.to_json}[args.format]
    sys.stdout.write(writer(results, table))

    if args.chrome_trace or args.chrome_trace_predicted:
        try:
            written = chrome_traces(args, runs, results)
        except (OSError, ValueError) as exc:
            print(f"mpipar analyze: error: chrome trace: {exc}", file=sys.stderr)
            return 2
        print("chrome traces: " + ", ".join(written), file=sys.stderr)

    if args.plots:
        from mpipar.analysis import plots

        ext = args.plot_format
        written = []
        for r, res in zip(runs, results, strict=True):
            slug = _slug(r.name)
            step = args.step if args.step is not None else res["steps"][0]
            p = os.path.join(args.plots, f"timeline_{slug}.{ext}")
            plots.timeline(r, p, step=step)
            q = os.path.join(args.plots, f"breakdown_{slug}.{ext}")
            plots.breakdown_bars(r, q, step=args.step)
            written += [p, q]
        if len(results) > 1:
            p = os.path.join(args.plots, f"scaling.{ext}")
            plots.scaling(results, p)
            written.append(p)
        # the plot list goes to stderr so csv/json on stdout stay machine-readable
        print("plots: " + ", ".join(written), file=sys.stderr)
    return 0


def chrome_traces(args, runs, results) -> list[str]:
    """Measured and predicted timelines of each run's step as Chrome Trace Event JSON."""
    from mpipar.analysis import chrome_trace as ct

    measured, predicted = [], []
    for i, (r, res) in enumerate(zip(runs, results, strict=True)):
        step = args.step if args.step is not None else res["steps"][0]
        measured += ct.measured_events(r, [step], pid=2 * i + 1)
        sim = ct.predicted_for(r, res["steps"])
        predicted += ct.predicted_events(sim, f"predicted: {r.name}", pid=2 * i + 2)
    written = []
    if args.chrome_trace_predicted:
        ct.write(args.chrome_trace_predicted, predicted)
        written.append(args.chrome_trace_predicted)
        predicted = []
    if args.chrome_trace:
        ct.write(args.chrome_trace, measured + predicted)
        written.append(args.chrome_trace)
    return written
