"""What ``mpipar commbench`` prints and writes: the tables, the HDF5 result, the tuned table.

The measurements come from ``commbench.run_benchmark`` (point-to-point) and
``collbench.bench_kind`` (collectives); nothing here talks MPI.
"""

from __future__ import annotations

import json
from pathlib import Path

from mpipar.files import atomic_h5, write_text_atomic
from mpipar.mpi import tuning
from mpipar.mpi.bench.sizes import format_size


def write_tuned(path, result) -> None:
    """The tuned table (JSON), merged with the communicator sizes already in the file there."""
    tuned = result["tuned"]
    try:
        old = json.loads(open(path).read())
        tuning.validate(old, str(path))
    except (OSError, ValueError):
        old = None
    if old is not None and not tuning.same_topology(old.get("topology") or tuning.ONE_NODE,
                                                     tuned.get("topology") or tuning.ONE_NODE):
        old = None  # tuned on another topology: replaced, never mixed
    if old is not None:
        for kind, by_p in tuned["choices"].items():
            old["choices"].setdefault(kind, {}).update(by_p)
        old["mpi_library"] = tuned["mpi_library"]
        if "topology" in tuned:
            old["topology"] = tuned["topology"]
        tuned = old
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(tuned, indent=1) + "\n")


def format_tables(result) -> str:
    a = result["attrs"]
    lines = [
        f"commbench: {a['world_size']} ranks on {','.join(sorted(set(a['hostnames'])))}, "
        f"{a['mpi_library']}, device {a['device']}, staging {a['staging']}, "
        f"median of {a['iters']} interleaved iterations",
    ]
    lines.append(f"collectives: MPIPAR_COLLECTIVES={a['collectives_mode']}, auto chooses from "
                 f"{a['collectives_table']}")
    if "topology" in a:
        lines.append(f"topology: {tuning.describe_topology(a['topology'])} (recorded with the "
                     f"tuned table; MPIPAR_LINK_RATE names the link)")
    for name, title, bw in (
            ("p2p", "ping-pong world ranks 0 <-> 1: one-way time (Comm traced, as by default)",
             "GB/s"),
            ("p2p_untraced", "the same with Comm's tracer off (run.trace = false): the rest of "
             "the difference is the trace event", "GB/s")):
        if name not in result:
            continue
        lines += [
            "",
            title,
            f"{'bytes':>7} {'raw us':>10} {'comm us':>10} {'comm/raw':>9} "
            f"{'raw ' + bw:>12} {'comm ' + bw:>13}",
        ]
        for row in result[name]:
            lines.append(
                f"{format_size(int(row['bytes'])):>7} {row['raw_s'] * 1e6:>10.1f} "
                f"{row['comm_s'] * 1e6:>10.1f} {row['ratio']:>9.2f} "
                f"{row['raw_gbps']:>12.3f} {row['comm_gbps']:>13.3f}"
            )
    for kind, rows in result["collectives"].items():
        lines += format_kind(kind, rows, a["world_size"])
    return "\n".join(lines)


def write_result(path, result) -> None:
    """HDF5: /p2p, /p2p_untraced and /allreduce (RESULT_DTYPE tables: raw beside Comm traced,
    untraced, and auto for all-reduce),
    /p2p_raw_s and /p2p_comm_s (samples [size, iteration]), /collectives/<kind> (COLL_DTYPE) and
    /collectives/<kind>_s (samples [variant, size, iteration], variants in the attribute
    ``variants``), /tuned (the --tune table as JSON text); attributes describe the run. Written
    atomically (temp file, rename)."""
    with atomic_h5(path) as f:
        f.attrs["kind"] = "commbench"
        for key, value in result["attrs"].items():
            f.attrs[key] = json.dumps(value) if isinstance(value, (list, dict)) else value
        f.create_dataset("p2p", data=result["p2p"])
        f.create_dataset("p2p_untraced", data=result["p2p_untraced"])
        raw, comm = result["p2p_samples"]
        f.create_dataset("p2p_raw_s", data=raw)
        f.create_dataset("p2p_comm_s", data=comm)
        if result["allreduce"] is not None:
            f.create_dataset("allreduce", data=result["allreduce"])
        for kind, rows in result["collectives"].items():
            f.create_dataset(f"collectives/{kind}", data=rows)
            f.create_dataset(f"collectives/{kind}_s", data=result["collective_samples"][kind])
        f.attrs["tuned"] = json.dumps(result["tuned"])


def format_kind(kind, rows, n) -> list[str]:
    title = {"allreduce": "all-reduce", "reduce_scatter": "reduce-scatter",
             "allgather": "all-gather",
             "allreduce_registered": "all-reduce on a registered buffer (shm: zero-copy)",
             "reduce_scatter_registered": "reduce-scatter on a registered buffer (shm: "
                                          "zero-copy)"}[kind]
    lines = ["", f"{title} over {n} ranks (float32; times in us; bus = nccl-tests bus GB/s)",
             f"{'bytes':>7} {'raw':>9} {'library':>9} {'ring':>9} {'rabens.':>9} {'shm':>9} "
             f"{'hier':>9} {'auto':>9} "
             f"{'choice':>12} {'auto/raw':>8} {'raw bus':>8} {'auto bus':>8} {'best':>12}"]
    for r in rows:
        lines.append(
            f"{format_size(int(r['bytes'])):>7} {r['raw_s'] * 1e6:>9.1f} "
            f"{r['library_s'] * 1e6:>9.1f} {r['ring_s'] * 1e6:>9.1f} "
            f"{r['rabenseifner_s'] * 1e6:>9.1f} {r['shm_s'] * 1e6:>9.1f} "
            f"{r['hier_s'] * 1e6:>9.1f} {r['auto_s'] * 1e6:>9.1f} "
            f"{r['choice'].decode():>12} {r['ratio']:>8.2f} {r['raw_busbw']:>8.3f} "
            f"{r['auto_busbw']:>8.3f} {r['best'].decode():>12}"
        )
    return lines
