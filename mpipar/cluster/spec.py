"""What an emulated cluster is: its name, nodes, addresses, link rate and the state file.

Pure: parses and checks the request, names every object `up` will make, and reads and writes
the state file that `down` trusts (beside a scan by name prefix, for what a crash left behind).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_NODES = 8
STATE_ROOT = Path(os.environ.get("MPIPAR_CLUSTER_STATE", "/run/mpipar-cluster"))
SUBNET = "10.224.0"  # inside the bridge namespace only: nothing outside can route to it
NODE_IFACE = "eth0"
BRIDGE = "br0"
# tc's rate units (bits per second), the ones `--link` accepts
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,5}$")  # short: interface names carry it (15 chars max)
_SIZE = re.compile(r"^\d+[kmg]?$", re.IGNORECASE)
MIN_RATE_BPS = 8_000          # below this tbf's burst arithmetic stops making sense
MAX_RATE_BPS = 100 * 10**9    # more than a veth carries anyway


class ClusterError(RuntimeError):
    """Bad input or an environment that cannot host the cluster: one line, said as is."""


def parse_rate(text: str) -> int:
    """'1gbit' -> 1_000_000_000 (bits per second); tc's own units."""
    m = _RATE.match(text.strip().lower())
    if not m:
        raise ClusterError(f"--link {text!r}: give a rate as tc writes it, e.g. 200mbit, 1gbit, "
                           "10gbit (units bit, kbit, mbit, gbit)")
    bps = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ClusterError(f"--link {text}: the rate must lie between 8kbit and 100gbit")
    return bps


BUCKET_S = 150e-6  # tbf's bucket in time at the rate
BUCKET_MAX = 256 * 1024  # 10 Gbit/s: the bucket still refills between timer wake-ups
JUMBO, ETHERNET = 9000, 1500  # the link's MTU: jumbo frames where the bucket holds one
FRAME = 216  # headers beyond the MTU that the bucket must hold too (tc rounds it down a little)


def link_mtu(rate_bps: int) -> int:
    """The link's MTU: jumbo frames (9000 bytes, as HPC Ethernet fabrics run) where the bucket
    of ``BUCKET_S`` at the rate holds one (1 Gbit/s and up), else 1500. tbf's bucket must hold
    a whole packet, and at 1500 bytes the per-packet work of a Gbit/s link starved it."""
    return JUMBO if rate_bps * BUCKET_S / 8 >= JUMBO + FRAME else ETHERNET


def tbf_burst_bytes(rate_bps: int) -> int:
    """tbf's bucket: 150 us at the rate, at least one packet, at most 256 KiB (200 Mbit/s:
    3.75 KB at MTU 1500, 1 Gbit/s: 18.75 KB, 10 Gbit/s: 187.5 KB). A message that finds the
    bucket full passes its first bucket's worth at once, so a message of S bytes crosses up to
    bucket / S faster than S over the rate: a bucket of 1 ms at the rate (64-256 KiB) let a
    64 KiB message, the tiny GPT's micro-batch activation, cross at about twice the rate at
    200 Mbit/s and 1 Gbit/s, so a slow link cost a pipeline almost nothing. A smaller bucket
    starves the link: it empties faster than the timer that refills it wakes up (one 9 KB
    packet at 1 Gbit/s: 0.72x the rate from 256 KiB up; 16 KiB at MTU 1500: 0.65x).
    experiments/README.md, section 9, has the measurements."""
    return max(link_mtu(rate_bps) + FRAME, min(BUCKET_MAX, int(rate_bps * BUCKET_S / 8)))


@dataclass
class ClusterSpec:
    name: str = "mpc"
    nodes: int = 2
    link: str = "1gbit"
    shm_size: str = "512m"
    cpus_per_node: int = 0        # 0: no CPU set
    # filled by `up`: node -> pid of the process holding its namespaces (pid 1 of its pid ns)
    holders: dict[str, int] = field(default_factory=dict)
    cpus: dict[str, str] = field(default_factory=dict)

    def check(self, ncpu: int) -> None:
        if not _NAME.match(self.name):
            raise ClusterError(f"--name {self.name!r}: 1-6 lower-case letters or digits, "
                               "starting with a letter")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ClusterError(f"--nodes {self.nodes}: give 1 to {MAX_NODES} nodes")
        parse_rate(self.link)
        if not _SIZE.match(self.shm_size):
            raise ClusterError(f"--shm-size {self.shm_size!r}: give a tmpfs size such as "
                               "256m or 1g")
        if self.cpus_per_node < 0 or self.cpus_per_node * self.nodes > ncpu:
            raise ClusterError(f"--cpus-per-node {self.cpus_per_node} x {self.nodes} nodes "
                               f"needs more than the {ncpu} CPUs here; give at most "
                               f"{ncpu // self.nodes}, or 0 for no CPU sets")

    # --- names of everything `up` makes (and `down` removes) ---------------------------------
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.nodes)]

    def netns(self, node: str) -> str:
        return f"{self.name}-{node}"

    @property
    def bridge_netns(self) -> str:
        return f"{self.name}-bridge"

    def bridge_port(self, node: str) -> str:
        return f"{self.name}-{node}"  # the veth end in the bridge namespace

    def address(self, node: str) -> str:
        return f"{SUBNET}.{int(node[4:]) + 1}"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.name

    @property
    def launcher(self) -> Path:
        return self.state_dir / "launcher"

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.address(n)} {n}" for n in self.node_names()]
        return "\n".join(lines) + "\n"


def state_path(name: str) -> Path:
    return STATE_ROOT / name / "state.json"


def save(spec: ClusterSpec) -> None:
    spec.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_path(spec.name).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(spec), indent=1))
    os.replace(tmp, state_path(spec.name))


def load(name: str) -> ClusterSpec | None:
    try:
        return ClusterSpec(**json.loads(state_path(name).read_text()))
    except (OSError, ValueError, TypeError):
        return None
