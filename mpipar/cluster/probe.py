"""Where the bytes went: interface counters of every node, and the transports UCX chose.

Byte counters come from `ip -s -j link` on each node's eth0 (the only way out of a node);
transports from UCX's own protocol tables (`UCX_PROTO_INFO=y`), which name every peer class
(intra-node, inter-node) with the transport that carries each message size.
"""

from __future__ import annotations

import json
import re
import subprocess

from .spec import NODE_IFACE, ClusterSpec

# the environment that makes each rank print its protocol tables to stderr
PROTO_INFO_ENV = {"UCX_PROTO_INFO": "y"}
_PREFIX = re.compile(r"^\[[^]]*\]\s*\[([^]]*)\]\s*")  # [timestamp] [host:pid:thread]
_HEADER = re.compile(r"\|\s*ucp_context_\d+\s+(intra-node|inter-node)\s+cfg#\d+\s*\|\s*"
                     r"tagged message by ucp_tag_send\* from host memory\s*\|")


def counters(spec: ClusterSpec) -> dict[str, dict[str, int]]:
    """node -> {"tx": bytes, "rx": bytes} on its link, as the kernel counts them."""
    out = {}
    for node in spec.node_names():
        text = subprocess.run(["ip", "-n", spec.netns(node), "-s", "-j", "link", "show",
                               NODE_IFACE], capture_output=True, text=True, check=True).stdout
        stats = json.loads(text)[0]["stats64"]
        out[node] = {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}
    return out


def delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {n: {k: after[n][k] - before[n][k] for k in ("tx", "rx")} for n in after}


def transports(ucx_log: str) -> dict[str, set[str]]:
    """From UCX_PROTO_INFO output: peer class -> transports that carry tagged messages
    ({'inter-node': {'tcp/eth0'}, 'intra-node': {'sysv/memory', 'cma/memory'}}). Every rank
    writes its tables to the same stream, so lines of two ranks' tables can interleave: each
    line belongs to the table its own process (the ``[host:pid:thread]`` prefix) last opened."""
    found: dict[str, set[str]] = {}
    current: dict[str, str | None] = {}  # process prefix -> the peer class of its open table
    for line in ucx_log.splitlines():
        pre = _PREFIX.match(line)
        proc = pre.group(1) if pre else ""
        line = line[pre.end():] if pre else line
        m = _HEADER.search(line)
        if m:
            current[proc] = m.group(1)
            found.setdefault(m.group(1), set())
            continue
        if current.get(proc) is None:
            continue
        if "ucp_context" in line:  # another table begins
            current[proc] = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "/" in cells[2]:  # size range | protocol | transport/device
            found[current[proc]].add(cells[2])
    return found
