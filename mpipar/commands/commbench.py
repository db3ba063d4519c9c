"""``mpipar commbench``: point-to-point and all-reduce through mpipar's Comm beside raw mpi4py.

Run under mpiexec: ``mpiexec -n 2 mpipar commbench --iters 20 --out commbench.h5``.
"""

from __future__ import annotations

HELP = "benchmark p2p and all-reduce through mpipar's Comm beside raw mpi4py (run under mpiexec)"


def add_arguments(parser) -> None:
    from mpipar.mpi.commbench import DEFAULT_SIZES

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


def run(args) -> int:
    import sys

    from mpipar.mpi import failfast
    from mpipar.mpi.commbench import (
        format_tables,
        parse_sizes,
        preflight,
        run_benchmark,
        write_result,
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

    failfast.install()
    rank, error = preflight(args.out)  # every rank gets the same verdict and stops together
    if error:
        if rank == 0:
            print(f"mpipar commbench: {error}", file=sys.stderr)
        return 2

    staging = {"auto": None, "on": True, "off": False}[args.staging]
    result = run_benchmark(sizes, args.iters, args.warmup, device=args.device, staging=staging)
    if result is not None:
        print(format_tables(result), flush=True)
        if args.out:
            write_result(args.out, result)
            print(f"\nwrote {args.out}", flush=True)
    return 0
