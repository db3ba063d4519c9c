"""Point-to-point across an emulated cluster's shaped link against inside one node.

Brings up a 2-node emulated cluster (`mpipar cluster`, root) once per link rate and ping-pongs
1 KiB..64 MiB between two ranks: one on each node (across the link: UCX over TCP) and, once,
both on node0 (inside a node: UCX shared memory). The link rate does not touch a node's
inside, so that row is measured at the first rate only. Prints one-way latency and bandwidth per
size, and each rate's bandwidth from 1 MiB up as a fraction of the configured rate; writes
OUT/multinode.h5, OUT/multinode.png and OUT/results.{csv,json,md}. Then the training rows
(experiments/multinode_train.py: dp=2 x tp=2 with tp inside a node or across, dp=2 on one node
or two, per --train-rates) into OUT/train/results.{csv,json,md}; with a spec of this machine
(--spec FILE or $MPIPAR_SPEC) each training row's planned step beside the measured one and,
per rate, tp across minus tp inside, measured and planned (OUT/train/placement/). Tears the
cluster down on exit, also on an error or Ctrl-C.

Run (root): ``python experiments/multinode.py [--rates 200mbit,1gbit,10gbit]
[--train-rates 10gbit,200mbit] [--no-train] [--quick]`` (a few minutes: the 200mbit sizes and
runs dominate).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import multinode_plan  # noqa: E402
import multinode_train  # noqa: E402

from mpipar.cluster import nodes  # noqa: E402
from mpipar.cluster.spec import ClusterError, ClusterSpec, parse_rate  # noqa: E402
from mpipar.mpi.bench.sizes import format_size  # noqa: E402
from mpipar.plan import PlanError  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "multinode_driver.py"
NAME = "mnx"
SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "1K,64K,1M"


def measure(spec: ClusterSpec, hosts: list[str], ppn: int, out: Path, label: str, args) -> dict:
    path = out / f"{label}.json"
    if args.reuse and path.exists():
        return json.loads(path.read_text())
    cmd = nodes.mpiexec_argv(spec, ppn, [sys.executable, str(DRIVER), "--sizes", args.sizes,
                                         "--reps-scale", str(args.reps_scale),
                                         "--json", str(path)], hosts)
    common.run_command(cmd, args.timeout, label)
    return json.loads(path.read_text())


def run_all(args, out: Path) -> dict[str, dict]:
    """label -> the driver's result; labels 'inside' and 'link-<rate>'."""
    results = {}
    for k, rate in enumerate(args.rates):
        spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link=rate, shm_size="256m"))
        try:
            if k == 0:
                results["inside"] = measure(spec, ["node0"], 2, out, "inside", args)
            results[f"link-{rate}"] = measure(spec, ["node0", "node1"], 1, out,
                                              f"link-{rate}", args)
        finally:
            nodes.down(NAME)
    return results


def rows_of(results: dict[str, dict]) -> tuple[list[dict], list[str]]:
    labels = list(results)
    sizes = [r["bytes"] for r in results[labels[0]]["rows"]]
    rows = []
    for i, nbytes in enumerate(sizes):
        row = {"size": format_size(nbytes)}
        for label in labels:
            t = results[label]["rows"][i]["median_s"]
            row[f"{label} us"] = round(t * 1e6, 1)
            row[f"{label} MB/s"] = round(nbytes / t / 1e6, 1)
        rows.append(row)
    columns = ["size"] + [f"{lab} {u}" for lab in labels for u in ("us", "MB/s")]
    return rows, columns


def rate_fractions(results: dict[str, dict]) -> list[dict]:
    """Each rate's measured bandwidth from 1 MiB up over the configured rate."""
    out = []
    for label, res in results.items():
        if not label.startswith("link-"):
            continue
        rate_bps = parse_rate(label[5:])
        big = [r for r in res["rows"] if r["bytes"] >= 1 << 20]
        fr = [r["bytes"] * 8 / r["median_s"] / rate_bps for r in big]
        out.append({"link": label[5:], "sizes >= 1M": len(fr),
                    "min fraction": round(min(fr), 3) if fr else None,
                    "max fraction": round(max(fr), 3) if fr else None})
    return out


def write_h5(path: Path, results: dict[str, dict], meta: dict) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for k, v in meta.items():
            f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
        for label, res in results.items():
            g = f.create_group(label)
            g.attrs["hosts"] = ",".join(res["hosts"])
            for key in ("bytes", "reps", "median_s", "min_s", "max_s"):
                g[key] = np.array([r[key] for r in res["rows"]])


def plot(path: Path, results: dict[str, dict]) -> None:
    plt = common.pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res in results.items():
        b = np.array([r["bytes"] for r in res["rows"]])
        t = np.array([r["median_s"] for r in res["rows"]])
        line = ax_t.loglog(b, t * 1e6, marker="o", label=label)[0]
        ax_b.loglog(b, b / t / 1e6, marker="o", label=label, color=line.get_color())
        if label.startswith("link-"):
            ax_b.axhline(parse_rate(label[5:]) / 8e6, ls="--", lw=0.8, color=line.get_color())
    ax_t.set(xlabel="message bytes", ylabel="one-way time (us)", title="latency")
    ax_b.set(xlabel="message bytes", ylabel="MB/s (dashed: configured rate)", title="bandwidth")
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = common.parser("multinode", __doc__)
    p.add_argument("--rates", default="200mbit,1gbit,10gbit",
                   help="link rates, comma-separated (default 200mbit,1gbit,10gbit)")
    p.add_argument("--sizes", default=None, help=f"message sizes (default {SIZES})")
    p.add_argument("--reps-scale", type=float, default=1.0,
                   help="scale the repetitions per size (default 1)")
    p.add_argument("--train-rates", default=None,
                   help=f"link rates of the training rows (default {multinode_train.RATES}; "
                        f"--quick: {multinode_train.QUICK_RATES})")
    p.add_argument("--no-train", action="store_true", help="point-to-point rows only")
    p.add_argument("--spec", default=None,
                   help="a spec of this machine (mpipar plan measure --out FILE; default "
                        "$MPIPAR_SPEC): the training rows' planned columns")
    args = p.parse_args(argv)
    args.rates = [r for r in args.rates.split(",") if r]
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    if args.quick:
        args.rates, args.reps_scale = args.rates[1:2] or args.rates, 0.1
    out = common.out_dir(args, "multinode")
    # SIGTERM becomes an exception, so the `finally` that removes the cluster runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for rate in args.rates:
            parse_rate(rate)
        nodes.down(NAME)  # what an earlier, killed run may have left
        results = run_all(args, out)
    except (ClusterError, common.ExperimentError) as e:
        print(f"experiments/multinode.py: {e}", file=sys.stderr)
        return 2
    meta = {**common.machine_note(), "rates": args.rates, "sizes": args.sizes}
    rows, columns = rows_of(results)
    common.write_results(out, "p2p one-way time and bandwidth (median)", rows, columns, meta)
    fr = rate_fractions(results)
    print(common.text_table(fr, list(fr[0])) if fr else "", flush=True)
    write_h5(out / "multinode.h5", results, meta)
    plot(out / "multinode.png", results)
    print(f"wrote {out / 'multinode.h5'}, {out / 'multinode.png'}")
    if not args.no_train:
        args.p2p_latency = multinode_plan.p2p_latencies(results)
        try:
            multinode_train.run(args, out / "train")
        except (ClusterError, common.ExperimentError, PlanError) as e:
            print(f"experiments/multinode.py: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
