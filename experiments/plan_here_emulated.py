"""Table 3 of experiments/plan_here.py: the rows on the emulated 2-node cluster.

Per link rate: ``mpipar.cluster`` brings up 2 nodes joined by a link shaped to that rate; the
link is measured once (``mpipar.plan.measure.links``, commbench with one rank per node: what
``mpipar plan measure --inter-node`` writes as ``[inter_node]``); every row runs
``--repeats`` times, interleaved, through the cluster's launcher with its ranks split evenly
over the nodes (ranks 0..k-1 on node0); the cluster is torn down before the next rate (and on
an error or SIGTERM). The spec of a rate is the machine's (``--spec``) with that measured link
as ``[inter_node]`` and the machine's cores split over the nodes
(``experiments/multinode_plan.emulated``: both nodes share this machine's cores), never fitted
to the rows. Each row is planned at its ranks per node, so the axes whose groups cross the link
are priced there (``mpipar.plan.placement``). As in tables 1 and 2, the machine's compute is
sampled beside the runs (``plan.resample``: before each round of rows and after the last, stored
in ``<out>/<rate>/specs``; not with ``--no-sample``) and each row is planned from the median of
the samples, the link of its rate put over each: the machine's speed moved by a third between
two ``plan measure`` runs ten minutes apart, which a single spec carries into every row.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import multinode_plan
import plan_here

from mpipar.cluster import nodes
from mpipar.cluster.spec import ClusterSpec, parse_rate

NAME = "mpph"  # the cluster's name: its namespaces and files are prefixed with it
NODES = 2
RATES = "1gbit,200mbit"


def rows(quick: bool):
    """(model, dp, pp, tp, schedule, v, m, recompute) on 2 nodes: each axis across the link
    once (dp, pp, tp of the tiny GPT; pp and dp of the larger one; the MLP's pp), and a 4-rank
    grid with two ranks per node."""
    if quick:
        return [("tiny", 2, 1, 1, "1f1b", 1, 4, "none"), ("tiny", 1, 2, 1, "1f1b", 1, 4, "none")]
    return [("tiny", 2, 1, 1, "1f1b", 1, 4, "none"), ("tiny", 1, 2, 1, "1f1b", 1, 4, "none"),
            ("tiny", 1, 1, 2, "1f1b", 1, 4, "none"), ("gpt8", 1, 2, 1, "1f1b", 1, 4, "none"),
            ("gpt8", 2, 1, 1, "1f1b", 1, 4, "none"), ("gpt8", 2, 2, 1, "1f1b", 1, 4, "none"),
            ("mlp", 1, 2, 1, "1f1b", 1, 4, "none")]


def ppn(row) -> int:
    return row[1] * row[2] * row[3] // NODES


def measure_link(quick: bool, timeout: float) -> tuple[float, float]:
    """(latency s, bytes/s) of the running cluster's link (commbench, one rank per node)."""
    from mpipar.plan.measure import links

    return links(2, True, quick, timeout, cluster=NAME)["p2p"]


def on_link(spec, rate: str, link: tuple[float, float]):
    """The machine's spec ``spec`` with the measured ``link`` across the nodes (module doc)."""
    from mpipar.plan.cluster import Link

    lat, bw = link
    spec = multinode_plan.emulated(spec, rate, lat, NODES)
    return dataclasses.replace(spec, inter=Link(bandwidth=bw, latency=lat, efficiency=1.0))


def spec_set(args, base: dict, folder: Path, rate: str, link):
    """The rows' ``SpecSet``: the base spec with the samples stored in ``folder`` (none with
    ``--no-sample``), each with the link of ``rate`` over it."""
    from mpipar.plan.resample import SpecSet, load_samples
    from mpipar.plan.resample import spec_set as machine_specs

    got = machine_specs(base, [] if args.no_sample else load_samples(folder))
    return SpecSet(on_link(got.median, rate, link),
                   [(t, on_link(c, rate, link)) for t, c in got.samples])


def run(args, out: Path, base: dict) -> tuple[list[dict], dict]:
    rates = [r for r in (args.rates or RATES).split(",") if r]
    if args.quick:
        rates = rates[:1]
    for rate in rates:
        parse_rate(rate)  # a bad rate: one ClusterError before anything is made
    table = rows(args.quick)
    got, links = [], {}
    nodes.down(NAME)  # what an earlier, killed run may have left
    for rate in rates:
        folder = out / rate / "specs"
        between = None if args.no_sample else plan_here.sampler(args, folder, table)
        spec = nodes.up(ClusterSpec(name=NAME, nodes=NODES, link=rate, shm_size="256m"))
        try:
            link = measure_link(args.quick, args.timeout)
            links[rate] = {"latency_us": link[0] * 1e6, "bandwidth_mbs": link[1] / 1e6}
            print(f"  link at {rate}: {links[rate]['latency_us']:.1f} us, "
                  f"{links[rate]['bandwidth_mbs']:.1f} MB/s (commbench, 1 rank per node)",
                  flush=True)
            plan_here.train_all(args, out / rate, table,
                                lambda row, s=spec: nodes.mpiexec_argv(s, ppn(row), []),
                                between)
        finally:
            nodes.down(NAME)
        specs = spec_set(args, base, folder, rate, link)
        for row in table:
            r = plan_here.measure_row(args, out / rate, row, specs, f"2 nodes @{rate}",
                                      ppn(row))
            got.append(r)
    ok = sum(1 for r in got if r["ok"])
    print(f"emulated 2 nodes: {ok} of {len(got)} rows within {plan_here.STEP_PCT:.0f} % (step) "
          f"and {plan_here.MEM_PCT:.0f} % (memory) at {', '.join(rates)}")
    return got, {"rates": rates, "links": links, "emulated_ok": ok}


if __name__ == "__main__":
    sys.exit("run it through experiments/plan_here.py --emulated")
