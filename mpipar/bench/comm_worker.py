"""mpipar's Comm beside raw mpi4py (``mpipar.mpi.bench``), run under ``mpiexec -n 2`` by
``mpipar bench``; rank 0 writes the two tables to --json."""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpipar.bench.comm_worker")
    ap.add_argument("--sizes", default="4K,256K,4M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    from mpipar.mpi.bench import parse_sizes, run_benchmark

    res = run_benchmark(parse_sizes(a.sizes), iters=a.iters, warmup=2)
    if res is not None:
        with open(a.json, "w") as f:
            json.dump({k: [[float(v) for v in row] for row in res[k]] for k in ("p2p", "allreduce")}
                      | {"attrs": res["attrs"]}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
