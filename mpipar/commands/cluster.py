"""`mpipar cluster up|down|status|exec|mpiexec|kill|link`: nodes on one machine, as namespaces.

    mpipar cluster up --nodes 2 --link 1gbit [--shm-size 512m] [--cpus-per-node 1]
    mpipar cluster mpiexec --ppn 2 -- mpipar train --config C --dp 2 --pp 2   # ranks over nodes
    mpipar cluster exec node1 -- hostname
    mpipar cluster kill node1 / mpipar cluster link node1 down|up   # a node lost, a cable pulled
    mpipar cluster status          # nodes, addresses, link, bytes on each node's link
    mpipar cluster down            # removes everything, also after a crash
"""

from __future__ import annotations

import argparse
import os
import sys

HELP = "an emulated cluster on this machine: namespaces as nodes, tc-shaped links (root)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("up", help="make the nodes, the bridge and the shaped links")
    p.add_argument("--nodes", type=int, default=2, help="nodes node0..nodeN-1 (1-8; default 2)")
    p.add_argument("--link", default="1gbit", help="each node's link rate, as tc writes it "
                   "(200mbit, 1gbit, 10gbit; default 1gbit)")
    p.add_argument("--shm-size", default="512m", help="each node's /dev/shm (default 512m)")
    p.add_argument("--cpus-per-node", type=int, default=0,
                   help="pin each node to this many CPUs of its own (default 0: no CPU set)")
    for name in ("down", "status"):
        sub.add_parser(name, help={"down": "remove everything the cluster made (idempotent)",
                                   "status": "nodes, link, byte counters"}[name])
    p = sub.add_parser("exec", help="run a command inside one node")
    p.add_argument("node", help="node0, node1, ...")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    p = sub.add_parser("kill", help="kill every process of one node at once (a node lost)")
    p.add_argument("node", help="node0, node1, ...")
    p = sub.add_parser("link", help="bring one node's link down or up (a cable pulled)")
    p.add_argument("node", help="node0, node1, ...")
    p.add_argument("state", choices=("up", "down"))
    p = sub.add_parser("mpiexec", help="mpiexec across the nodes (Hydra, the cluster launcher)")
    p.add_argument("--ppn", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--hosts", help="comma-separated nodes (default: all)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    for p in sub.choices.values():
        p.add_argument("--name", default="mpc", help="cluster name, the prefix of everything it "
                       "makes (default mpc)")


def _command(cmd: list[str]) -> list[str]:
    cmd = cmd[1:] if cmd[:1] == ["--"] else cmd
    if not cmd:
        raise SystemExit("mpipar cluster: error: give the command after --")
    return cmd


def run(args: argparse.Namespace) -> int:
    from mpipar.cluster import nodes, probe
    from mpipar.cluster.spec import ClusterError, ClusterSpec

    try:
        if args.action == "up":
            spec = nodes.up(ClusterSpec(name=args.name, nodes=args.nodes, link=args.link,
                                        shm_size=args.shm_size,
                                        cpus_per_node=args.cpus_per_node))
            print(f"cluster {spec.name}: {spec.nodes} nodes at {spec.link}; launcher "
                  f"{spec.launcher}")
            return 0
        if args.action == "down":
            removed = nodes.down(args.name)
            print(f"cluster {args.name}: removed {len(removed)} things" if removed
                  else f"cluster {args.name}: nothing to remove")
            return 0
        spec = nodes.require(args.name)
        if args.action == "status":
            counts = probe.counters(spec)
            print(f"cluster {spec.name}: link {spec.link}, /dev/shm {spec.shm_size}, launcher "
                  f"{spec.launcher}")
            for node in spec.node_names():
                c = counts[node]
                print(f"  {node}  {spec.address(node):<12} pid {spec.holders[node]:<8} "
                      f"cpus {spec.cpus.get(node, 'all'):<6} tx {c['tx']:>14,} B  "
                      f"rx {c['rx']:>14,} B")
            return 0
        if args.action == "kill":
            print(f"{args.node}: killed {len(nodes.kill_node(spec, args.node))} processes")
            return 0
        if args.action == "link":
            nodes.set_link(spec, args.node, args.state == "up")
            print(f"{args.node}: link {args.state}")
            return 0
        if args.action == "exec":
            argv = nodes.enter_argv(spec, args.node) + _command(args.cmd)
        else:
            if args.ppn < 1:
                raise ClusterError(f"--ppn {args.ppn}: give at least 1 rank per node")
            hosts = args.hosts.split(",") if args.hosts else None
            argv = nodes.mpiexec_argv(spec, args.ppn, _command(args.cmd), hosts)
    except ClusterError as e:
        print(f"mpipar cluster: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 127  # not reached
