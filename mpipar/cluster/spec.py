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


BUCKET_MIN = 64 * 1024  # one GSO packet: tbf splits a larger packet, at a CPU cost per packet
BUCKET_MAX = 256 * 1024  # above, a 1 MiB message would cross partly unshaped


def tbf_burst_bytes(rate_bps: int) -> int:
    """The bucket: 1 ms at the rate, within 64-256 KiB (200 Mbit/s: 64 KiB, 1 Gbit/s: 125 KB,
    10 Gbit/s: 256 KiB, where 1 ms would be 1.25 MB and hold a whole 1 MiB message). A message
    that finds the bucket full would pass its first `burst` bytes at once (in a ping-pong the
    bucket refills while the answer travels back; ``tbf_peak_args`` now caps that drain), so
    without a peak rate a message of S bytes is measured up to burst / S too fast: at 1 MiB
    6 % (200 Mbit/s), 12 % (1 Gbit/s), 25 % (10 Gbit/s); at 4 MiB at most 6 %. A smaller bucket
    at 10 Gbit/s starves the link: with 128 or 64 KiB, 1-64 MiB ping-pongs fell far short of the
    rate on a loaded machine where 256 KiB reached it."""
    return max(BUCKET_MIN, min(BUCKET_MAX, rate_bps // 8 // 1000))


PEAK_FACTOR = 1.1  # a full bucket drains at most this much faster than the rate
PEAK_MTU = 128 * 1024  # the peak bucket; 64 KiB starved 10 Gbit/s to 0.3x the rate


def tbf_peak_args(rate_bps: int) -> list[str]:
    """tbf's second bucket: ``peakrate`` caps how fast a full ``burst`` bucket drains, so a
    1 MiB message that finds it full crosses at most ~PEAK_FACTOR x the rate (10 Gbit/s:
    0.98-1.09x in four runs, against 1.11-1.15x without it), while the 256 KiB bucket keeps
    large transfers at the rate. Peak 1.05x with a 128 KiB peak bucket starved 10 Gbit/s
    (0.48-0.92x from 1 MiB up); 1.1x kept 0.88-1.09x but for one 64 MiB row, as low as the
    runs without peakrate dipped on that loaded machine (ping-pong, ``multinode.py``)."""
    return ["peakrate", f"{int(rate_bps * PEAK_FACTOR)}bit", "mtu", str(PEAK_MTU)]


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
