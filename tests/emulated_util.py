"""Helpers of tests/test_emulated_cluster.py: can this machine host an emulated cluster, and
what of one is left on it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from mpipar.cluster import nodes
from mpipar.cluster.spec import ClusterSpec


def skip_reason(name: str) -> str | None:
    """Why an emulated cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root"
    missing = [t for t in nodes.TOOLS if shutil.which(t, path=os.environ["PATH"] +
                                                       ":/usr/sbin:/sbin") is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    ns = f"{name}-probe"
    try:
        for argv in (["ip", "netns", "add", ns],
                     ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                      "1gbit", "burst", "131072", "latency", "50ms"]):
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                return f"`{' '.join(argv[:4])}` fails here: {proc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def leftovers(name: str) -> list[str]:
    """Anything of cluster `name` still on the machine: namespaces, links, mounts, processes,
    state."""
    found = [f"netns {ns}" for ns in nodes.list_netns() if ns.startswith(f"{name}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if f" {name}-" in line]
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {m}" for m in mounts.splitlines() if f"/{name}-" in m or f"/{name}/" in m]
    for pid in Path("/proc").iterdir():
        if pid.name.isdigit():
            try:
                cmd = (pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"/mpipar-cluster/{name}/" in cmd or f"{name}-node" in cmd:
                found.append(f"process {pid.name}: {cmd[:80]}")
    if ClusterSpec(name=name).state_dir.exists():
        found.append("state dir")
    return found


def netns_inodes(name: str) -> set[str]:
    """The kernel's ids of cluster `name`'s network namespaces ("net:[4026532...]")."""
    return {f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]" for ns in nodes.list_netns()
            if ns.startswith(f"{name}-")}


def processes_in(inodes: set[str]) -> list[int]:
    """Live processes (zombies excepted) inside any of these network namespaces."""
    found = []
    for pid in Path("/proc").iterdir():
        try:
            if pid.name.isdigit() and os.readlink(pid / "ns" / "net") in inodes:
                if (pid / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid.name))
        except OSError:
            continue
    return found
