"""Bring an emulated cluster up and down: namespaces, a bridge, shaped veth links, node holders.

Each node is a network namespace (`ip netns`, named `<cluster>-nodeK`) plus one holder process
that owns the node's UTS, IPC and mount namespaces: it sets the hostname, mounts a tmpfs of
its own on /dev/shm, binds the cluster's hosts file over /etc/hosts and a boot id of its own
over /proc/sys/kernel/random/boot_id (as separate machines have; the hostname alone already
makes UCX treat the nodes as separate machines, see __init__), then sleeps. No PID namespace:
a launcher inside node0 must reach node1's namespaces through /proc, and setns into a sibling
PID namespace is not allowed. The nodes' veths meet on a bridge inside a namespace of its own
that has no address and forwards nothing, so no packet can leave the set of namespaces made
here. `down` finds everything by the state file and by name prefix,
so it also cleans up after a crash, and it is what a failed `up` calls before it says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

from .spec import (
    BRIDGE,
    NODE_IFACE,
    ClusterError,
    ClusterSpec,
    link_mtu,
    load,
    parse_rate,
    save,
    tbf_burst_bytes,
)

TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "umount", "mountpoint", "sh", "sleep",
         "taskset")
READY_TIMEOUT_S = 15.0
LOST_PREFIX = "[mpipar]"  # the launcher's line on a lost node, like the ranks' failfast lines


def _run(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{what}: {err[-1] if err else 'failed'} ({' '.join(argv)})")
    return proc.stdout


def check_environment() -> None:
    missing = [t for t in TOOLS if shutil.which(t, path=os.environ.get("PATH", "") +
                                                ":/usr/sbin:/sbin") is None]
    if missing:
        raise ClusterError(f"missing tools: {', '.join(missing)} (install iproute2 and "
                           "util-linux)")
    if os.geteuid() != 0:
        raise ClusterError("an emulated cluster needs root (network and mount namespaces); "
                           "run as root")


def list_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _leftover_netns(name: str) -> list[str]:
    return [ns for ns in list_netns() if ns.startswith(f"{name}-")]


def up(spec: ClusterSpec) -> ClusterSpec:
    """Make the cluster, or leave nothing and raise ClusterError saying why."""
    check_environment()
    spec.check(os.cpu_count() or 1)
    rate_bps = parse_rate(spec.link)
    in_use = _leftover_netns(spec.name)
    if load(spec.name) is not None or in_use:
        what = ", ".join(in_use) or "its state file exists"
        raise ClusterError(f"cluster {spec.name!r} is already up ({what}); `mpipar cluster "
                           f"down --name {spec.name}` first, or pick another --name")
    save(spec)  # first: a crash from here on leaves a state file that `down` reads
    try:
        _make(spec, rate_bps)
    except BaseException:
        down(spec.name)
        raise
    save(spec)
    return spec


def _make(spec: ClusterSpec, rate_bps: int) -> None:
    br = spec.bridge_netns
    _run(["ip", "netns", "add", br], "bridge namespace")
    _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], "bridge")
    _run(["ip", "-n", br, "link", "set", BRIDGE, "up"], "bridge up")
    (spec.state_dir / "hosts").write_text(spec.hosts_file())
    ncpu = os.cpu_count() or 1
    for k, node in enumerate(spec.node_names()):
        ns, port = spec.netns(node), spec.bridge_port(node)
        _run(["ip", "netns", "add", ns], f"{node} namespace")
        _run(["ip", "-n", ns, "link", "add", NODE_IFACE, "type", "veth", "peer", "name", port,
              "netns", br], f"{node} link")
        _run(["ip", "-n", ns, "addr", "add", f"{spec.address(node)}/24", "dev", NODE_IFACE],
             f"{node} address")
        for dev in ("lo", NODE_IFACE):
            _run(["ip", "-n", ns, "link", "set", dev, "up"], f"{node} {dev} up")
        _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE, "up"], f"{node} port")
        for where, dev in ((ns, NODE_IFACE), (br, port)):  # tbf's bucket holds one packet
            _run(["ip", "-n", where, "link", "set", dev, "mtu", str(link_mtu(rate_bps))],
                 f"{node} mtu")
        # shape both directions: the node's egress, and the bridge's egress towards the node
        for where, dev in ((ns, NODE_IFACE), (br, port)):
            _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                  f"{rate_bps}bit", "burst", str(tbf_burst_bytes(rate_bps)),
                  "latency", "50ms"],
                 f"--link {spec.link}: tc refused the rate")
        if spec.cpus_per_node:
            first = k * spec.cpus_per_node % ncpu
            spec.cpus[node] = ",".join(str((first + c) % ncpu)
                                       for c in range(spec.cpus_per_node))
        spec.holders[node] = _start_holder(spec, node)
        save(spec)
    _write_launcher(spec)


def _start_holder(spec: ClusterSpec, node: str) -> int:
    d = spec.state_dir
    ready = d / f"{node}.ready"
    (d / f"{node}.boot_id").write_text(str(uuid.uuid4()) + "\n")
    keep = d / f"{node}.cgroup"  # the host's cgroup tree, held while /sys is replaced
    keep.mkdir()
    # As `ip netns exec` does, a sysfs of the node's own network namespace replaces /sys
    # (/sys/class/net lists the node's interfaces, which UCX reads), but with the host's cgroup
    # tree moved over, which slurmd needs.
    script = (
        "set -e\n"
        f"hostname {node}\n"
        f"mount --rbind /sys/fs/cgroup {keep} 2>/dev/null || true\n"
        "umount -l /sys\n"
        "mount -t sysfs sysfs /sys\n"
        f"if mountpoint -q {keep}; then mount --rbind {keep} /sys/fs/cgroup; umount -l {keep}; fi\n"
        f"mount -t tmpfs -o size={spec.shm_size},mode=1777 {spec.name}-shm /dev/shm\n"
        f"mount --bind {d}/hosts /etc/hosts\n"
        f"mount --bind {d}/{node}.boot_id /proc/sys/kernel/random/boot_id\n"
        f"touch {ready}\n"
        "exec sleep infinity\n"
    )
    argv = ["unshare", "--uts", "--ipc", "--mount", "--propagation", "private",
            "nsenter", f"--net=/run/netns/{spec.netns(node)}", "sh", "-c", script]
    if node in spec.cpus:
        argv = ["taskset", "-c", spec.cpus[node]] + argv
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            err = proc.stderr.read().strip().splitlines() if proc.stderr else []
            raise ClusterError(f"{node}: its namespaces did not start: "
                               f"{err[-1] if err else 'exit ' + str(proc.returncode)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{node}: its namespaces did not start in {READY_TIMEOUT_S} s")
        time.sleep(0.02)
    proc.stderr.close()
    return proc.pid  # `unshare` became `nsenter`, then `sh`, then `sleep`: one process


def _write_launcher(spec: ClusterSpec) -> None:
    """The program Hydra's ssh launcher runs (`-launcher ssh -launcher-exec THIS`): it is
    called as `THIS [-opts] HOST CMD...`, like ssh, and runs CMD inside HOST's namespaces
    through a shell, as sshd would. It stays the proxy's parent instead of exec'ing it: when
    the proxy on HOST is killed by a signal (every process of the node killed at once: a node
    lost) or HOST's namespaces are gone, it says so in one line naming HOST, which Hydra's own
    message does not (``LOST``). A signal sent to it (Hydra ending the job) goes on to the
    proxy, and is not a lost node."""
    d = spec.state_dir
    text = f"""#!/bin/sh
# Hydra launcher for emulated cluster {spec.name}: enters node HOST's namespaces.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
pid=$(cat "{d}/$host.pid" 2>/dev/null) || {{
    echo "mpipar cluster launcher: no node '$host' in cluster {spec.name}" >&2; exit 255; }}
if ! kill -0 "$pid" 2>/dev/null; then
    echo "{LOST_PREFIX} $host: its namespaces are gone (holder pid $pid ended): node lost?" >&2
    exit 255
fi
cpus=$(cat "{d}/$host.cpus" 2>/dev/null || true)
set -- nsenter -t "$pid" -n -u -m -i --wd="$PWD" -- sh -c "$*"
[ -n "$cpus" ] && set -- taskset -c "$cpus" "$@"
"$@" <&0 &
child=$!
stopping=
trap 'stopping=1; kill -TERM $child 2>/dev/null' TERM INT HUP
# (the shell's own "Killed" report goes to /dev/null: the line below says more)
wait $child 2>/dev/null; rc=$?
while kill -0 $child 2>/dev/null; do wait $child 2>/dev/null; rc=$?; done  # a trap ends wait
# killed by a signal this launcher did not pass on (it passes TERM on when the job is ended)
if [ $rc -gt 128 ] && {{ [ -z "$stopping" ] || [ $rc -ne 143 ]; }}; then
    why="the MPI proxy on this host was killed (signal $((rc - 128)))"
    echo "{LOST_PREFIX} $host: $why: node lost?" >&2
fi
exit $rc
"""
    for node, pid in spec.holders.items():
        (d / f"{node}.pid").write_text(f"{pid}\n")
        if node in spec.cpus:
            (d / f"{node}.cpus").write_text(spec.cpus[node] + "\n")
    spec.launcher.write_text(text)
    spec.launcher.chmod(0o755)


def enter_argv(spec: ClusterSpec, node: str) -> list[str]:
    """argv prefix that runs a command inside `node` (its CPU set included)."""
    if node not in spec.holders:
        raise ClusterError(f"no node {node!r} in cluster {spec.name!r} "
                           f"(nodes: {', '.join(spec.holders) or 'none'})")
    argv = ["nsenter", "-t", str(spec.holders[node]), "-n", "-u", "-m", "-i",
            f"--wd={os.getcwd()}", "--"]
    if node in spec.cpus:
        argv = ["taskset", "-c", spec.cpus[node]] + argv
    return argv


def down(name: str) -> list[str]:
    """Remove everything cluster `name` made; idempotent. Returns what it removed."""
    removed: list[str] = []
    spec = load(name)
    victims = set(spec.holders.values()) if spec else set()
    namespaces = _leftover_netns(name)
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        victims.update(int(p) for p in out.split())
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid}")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in victims):
        if time.monotonic() > deadline:
            raise ClusterError(f"cluster {name}: processes {sorted(victims)} did not end")
        time.sleep(0.02)
    for ns in namespaces:  # deleting a namespace deletes its veth end and qdiscs
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        removed.append(f"namespace {ns}")
    state = ClusterSpec(name=name).state_dir
    if state.exists():
        shutil.rmtree(state, ignore_errors=True)
        removed.append(f"state {state}")
    return removed


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def mpiexec_argv(spec: ClusterSpec, ppn: int, command: list[str],
                 hosts: list[str] | None = None) -> list[str]:
    """Hydra started inside the first host, reaching the others through the cluster's
    launcher: `-hosts node0,node1 -ppn K` places ranks 0..K-1 on node0, the next K on node1."""
    hosts = hosts or spec.node_names()
    unknown = [h for h in hosts if h not in spec.holders]
    if unknown:
        raise ClusterError(f"no node {unknown[0]!r} in cluster {spec.name!r} "
                           f"(nodes: {', '.join(spec.holders)})")
    return enter_argv(spec, hosts[0]) + [
        "mpiexec", "-launcher", "ssh", "-launcher-exec", str(spec.launcher),
        "-hosts", ",".join(hosts), "-ppn", str(ppn)] + command


def require(name: str) -> ClusterSpec:
    spec = load(name)
    if spec is None or not spec.holders:
        raise ClusterError(f"no cluster {name!r} is up; `mpipar cluster up --name {name} "
                           "--nodes 2 --link 1gbit` first")
    dead = [n for n, p in spec.holders.items() if _zombie(p)]
    if dead:
        raise ClusterError(f"cluster {name!r}: node {dead[0]} is gone; `mpipar cluster down "
                           f"--name {name}` and bring it up again")
    return spec


def kill_node(spec: ClusterSpec, node: str) -> list[int]:
    """SIGKILL every process inside `node` at once but its holder: a node lost mid-run."""
    enter_argv(spec, node)  # names the node or raises
    out = subprocess.run(["ip", "netns", "pids", spec.netns(node)], capture_output=True,
                         text=True).stdout
    victims = [int(p) for p in out.split() if int(p) != spec.holders[node]]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def set_link(spec: ClusterSpec, node: str, up: bool) -> None:
    """Bring `node`'s link down (a cable pulled) or up again."""
    enter_argv(spec, node)
    _run(["ip", "-n", spec.netns(node), "link", "set", NODE_IFACE, "up" if up else "down"],
         f"{node} link {'up' if up else 'down'}")
