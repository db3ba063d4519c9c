"""``mpipar commbench``: point-to-point and collectives through mpipar's Comm beside raw mpi4py.

Run under mpiexec: ``mpiexec -n 2 mpipar commbench --iters 20 --out commbench.h5``; ``--tune``
also writes the fastest collective algorithm per size to the table ``Comm`` chooses from.
"""

from __future__ import annotations

HELP = ("benchmark p2p and collectives (every algorithm) through mpipar's Comm beside raw mpi4py "
        "(run under mpiexec); --tune writes the collectives table")


def add_arguments(parser) -> None:
    from mpipar.mpi.bench import DEFAULT_SIZES

    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES,
        help=f"comma-separated message sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    parser.add_argument("--out", default=None, help="write the tables to this HDF5 file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="arrays in host memory (NumPy) or on the GPU (CuPy)")
    parser.add_argument("--staging", choices=("auto", "on", "off"), default="auto",
                        help="Comm's host staging: auto (device arrays iff MPI is not "
                             "CUDA-aware), or forced on / off")
    parser.add_argument("--collectives", default="allreduce,reduce_scatter,allgather",
                        help="comma-separated collectives to measure (default all three)")
    parser.add_argument("--tune", action="store_true",
                        help="write the fastest algorithm per collective and size for this many "
                             "ranks to the table (--table) that MPIPAR_COLLECTIVES=auto reads")
    parser.add_argument("--table", default=None,
                        help="the table --tune writes (default $MPIPAR_COLLECTIVES_TABLE, else "
                             "~/.cache/mpipar/collectives.json)")


def run(args) -> int:
    import os
    import sys

    from mpipar.mpi import failfast, tuning
    from mpipar.mpi.algorithms import KINDS
    from mpipar.mpi.bench import (
        format_tables,
        parse_sizes,
        preflight,
        run_benchmark,
        write_result,
        write_tuned,
    )

    # validate everything before MPI starts
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        print(f"mpipar commbench: {exc}", file=sys.stderr)
        return 2
    if not sizes or args.iters < 1 or args.warmup < 0:
        print("mpipar commbench: need at least one size, --iters >= 1, --warmup >= 0",
              file=sys.stderr)
        return 2
    kinds = [k.strip() for k in args.collectives.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or (args.tune and not kinds):
        print(f"mpipar commbench: --collectives {args.collectives!r}: use some of "
              f"{','.join(KINDS)}", file=sys.stderr)
        return 2
    try:
        tuning.mode()
    except ValueError as exc:
        print(f"mpipar commbench: {exc}", file=sys.stderr)
        return 2
    table = args.table or os.environ.get(tuning.ENV_TABLE) or str(tuning.default_path())

    failfast.install()
    # every rank gets the same verdict and stops together
    rank, error = preflight(args.out, table if args.tune else None)
    if error:
        if rank == 0:
            print(f"mpipar commbench: {error}", file=sys.stderr)
        return 2

    staging = {"auto": None, "on": True, "off": False}[args.staging]
    result = run_benchmark(sizes, args.iters, args.warmup, device=args.device, staging=staging,
                           kinds=kinds)
    if result is not None:
        print(format_tables(result), flush=True)
        if args.out:
            write_result(args.out, result)
            print(f"\nwrote {args.out}", flush=True)
        if args.tune:
            write_tuned(table, result)
            print(f"wrote the collectives table {table} (MPIPAR_COLLECTIVES=auto reads it)",
                  flush=True)
    return 0
