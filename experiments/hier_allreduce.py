"""All-reduce on 2 nodes x 2 ranks: the library's flat algorithm, the node-aware one
(``mpi/hierarchical.py``) and what ``auto`` chooses, 1 KiB to 64 MiB.

One ``mpipar commbench --collectives allreduce`` run (every algorithm forced in turn, the raw
library call beside them, a random order per iteration, the slowest rank's time, medians) under
a launcher given by ``--mpiexec`` or ``$MPIPAR_HIER_MPIEXEC``: on the emulated cluster
``"mpipar cluster mpiexec --ppn 2 --"`` (its launcher sets ``MPIPAR_LINK_RATE``, recorded with
the topology); without one, ``"mpiexec -n 4 -launcher fork -hosts nodeA:2,nodeB:2"``, one machine
that MPI takes for two nodes (shared memory between them: it shows the structure, not a link).
Writes OUT/commbench.h5 (commbench's HDF5: every variant's samples, the topology, the hosts) and
OUT/results.csv|json|md (library, hier and auto per size, hier's speed-up over the library,
auto against the library). About 2-4 minutes at 1 Gbit/s; seconds with --quick.

Run: ``python experiments/hier_allreduce.py --mpiexec "mpipar cluster mpiexec --ppn 2 --" --link
1gbit`` (a cluster brought up with ``--nodes 2 --link 1gbit``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.common import (  # noqa: E402
    ROOT,
    ExperimentError,
    machine_note,
    out_dir,
    parser,
    run_command,
    write_results,
)

ENV_LAUNCH = "MPIPAR_HIER_MPIEXEC"
ONE_MACHINE = "mpiexec -n 4 -launcher fork -hosts nodeA:2,nodeB:2"
SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
COLUMNS = ["bytes", "raw_us", "library_us", "hier_us", "auto_us", "choice", "hier_speedup",
           "auto_vs_library"]


def rows_of(path) -> tuple[list[dict], dict]:
    """The table rows and the run's attributes from commbench's HDF5."""
    import json

    import h5py

    with h5py.File(path, "r") as f:
        data = f["collectives/allreduce"][()]
        attrs = {k: (json.loads(v) if k in ("topology", "hostnames") else v)
                 for k, v in f.attrs.items() if k != "tuned"}
    rows = []
    for r in data:
        lib, hier, auto = (float(r[f"{a}_s"]) for a in ("library", "hier", "auto"))
        rows.append({"bytes": int(r["bytes"]), "raw_us": float(r["raw_s"]) * 1e6,
                     "library_us": lib * 1e6, "hier_us": hier * 1e6, "auto_us": auto * 1e6,
                     "choice": r["choice"].decode(), "hier_speedup": lib / hier,
                     "auto_vs_library": auto / lib})
    return rows, attrs


def main(argv=None) -> int:
    p = parser("hier_allreduce", __doc__)
    p.add_argument("--mpiexec", default=os.environ.get(ENV_LAUNCH, ONE_MACHINE),
                   help=f"the launcher command for 2 nodes x 2 ranks (default ${ENV_LAUNCH}, "
                        f"else {ONE_MACHINE!r})")
    p.add_argument("--sizes", default=SIZES, help=f"all-reduce sizes (default {SIZES})")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per size")
    p.add_argument("--link", default=None,
                   help="the link rate to record with the topology (sets MPIPAR_LINK_RATE for "
                        "the ranks, where the launcher does not)")
    args = p.parse_args(argv)
    if args.link:
        os.environ["MPIPAR_LINK_RATE"] = args.link
    out = out_dir(args, "hier_allreduce")
    sizes, iters = ("1K,64K,2M", 2) if args.quick else (args.sizes, args.iters)
    h5 = out / "commbench.h5"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    cmd = shlex.split(args.mpiexec) + [
        sys.executable, "-m", "mpipar.cli", "commbench", "--collectives", "allreduce",
        "--sizes", sizes, "--iters", str(iters), "--warmup", "1", "--out", str(h5)]
    try:
        run_command(cmd, args.timeout * 4, "commbench allreduce")
    except ExperimentError as exc:
        print(f"hier_allreduce: {exc}", file=sys.stderr)
        return 1
    rows, attrs = rows_of(h5)
    topo = attrs.get("topology", {})
    if topo.get("nodes", 1) < 2 or all(r["hier_us"] != r["hier_us"] for r in rows):
        print(f"hier_allreduce: the ranks ran on {topo}: the node-aware all-reduce was not "
              f"offered (it needs 2+ nodes with 2+ ranks on some node); check --mpiexec",
              file=sys.stderr)
    meta = {"topology": topo, "hostnames": attrs.get("hostnames"), "mpiexec": args.mpiexec,
            "iters": iters, "collectives_table": attrs.get("collectives_table"),
            "mpi_library": attrs.get("mpi_library"), **machine_note()}
    write_results(out, "hier_allreduce", rows, COLUMNS, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
