"""``mpipar bench``: one-rank GPT training speed beside PyTorch eager, the GEMM peak, memory
against an analytic count, and (outside --quick) the comm layer beside raw mpi4py.

Example: ``mpipar bench --threads 1,2 --configs small,large --iters 10 --out bench.h5``.
"""

from __future__ import annotations

HELP = "benchmark mpipar against the GEMM peak, PyTorch eager and raw mpi4py (tables + HDF5)"
STEADY_S, STEADY_QUICK_S = 20.0, 1.0


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, few iterations, no comm benchmark (a smoke test)")
    parser.add_argument("--threads", default=None,
                        help="comma-separated BLAS/torch thread counts (default 1,2; quick: 1)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated shapes: tiny, small, large (default small,large; "
                             "quick: tiny)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed steps per side (default 10; quick: 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps (default 2; quick: 1)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the PyTorch column")
    parser.add_argument("--no-comm", action="store_true", help="leave out the comm benchmark")
    parser.add_argument("--out", default=None, help="write the tables to this HDF5 file")
    parser.add_argument("--steadiness", action="store_true",
                        help="instead: how steady this machine's speed is (fixed work timed "
                             "in short windows; mpipar/plan/steadiness.py): what a timing "
                             "comparison here can resolve")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"--steadiness: seconds sampled (default {STEADY_S:g}; quick: "
                             f"{STEADY_QUICK_S:g})")


def run(args) -> int:
    import sys

    if args.steadiness:
        return _steadiness(args)
    from mpipar.bench.run import format_tables, parse_list, run_bench, write_hdf5
    from mpipar.bench.steps import CONFIGS

    q = args.quick
    try:
        threads = parse_list(args.threads or ("1" if q else "1,2"), "threads", cast=int)
        configs = parse_list(args.configs or ("tiny" if q else "small,large"), "configs",
                             allowed=CONFIGS)
        iters = args.iters if args.iters is not None else (3 if q else 10)
        warmup = args.warmup if args.warmup is not None else (1 if q else 2)
        if iters < 1 or warmup < 0:
            raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {iters}, {warmup}")
        if args.out:
            from mpipar.trace import check_writable

            check_writable(args.out)
    except ValueError as exc:
        print(f"mpipar bench: {exc}", file=sys.stderr)
        return 2
    try:
        res = run_bench(threads, configs, iters, warmup, quick=q, use_torch=not args.no_torch,
                        comm=False if args.no_comm else None)
    except RuntimeError as exc:
        print(f"mpipar bench: {exc}", file=sys.stderr)
        return 1
    print(format_tables(res), flush=True)
    if args.out:
        write_hdf5(args.out, res)
        print(f"\nwrote {args.out}", flush=True)
    return 0


def _steadiness(args) -> int:
    """``--steadiness``: the table of ``plan.steadiness``; ``--out``: its windows as HDF5."""
    import sys

    from mpipar.plan import PlanError, steadiness

    seconds = args.seconds if args.seconds is not None else (
        STEADY_QUICK_S if args.quick else STEADY_S)
    if not seconds > 0:
        print(f"mpipar bench: --seconds must be > 0, got {seconds}", file=sys.stderr)
        return 2
    if args.out:
        from mpipar.trace import check_writable

        try:
            check_writable(args.out, "the steadiness windows", "pass --out FILE.h5 in a "
                           "writable directory")
        except ValueError as exc:
            print(f"mpipar bench: {exc}", file=sys.stderr)
            return 2
    try:
        got = steadiness.sample_one_thread(seconds)
    except PlanError as exc:
        print(f"mpipar bench: {exc}", file=sys.stderr)
        return 1
    summ = steadiness.summary(got)
    print("\n".join(steadiness.lines(summ)), flush=True)
    if args.out:
        steadiness.write_hdf5(args.out, got, summ)
        print(f"\nwrote {args.out}", flush=True)
    return 0
