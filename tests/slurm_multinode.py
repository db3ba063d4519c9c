"""A Slurm cluster over an emulated cluster's nodes: slurmctld in node0, one slurmd per node.

    spec = mpipar.cluster.nodes.up(ClusterSpec(name=..., nodes=2, link="1gbit"))
    slurm = MultiNodeSlurm.start(spec)  # raises ClusterUnavailable with the reason if it cannot
    slurm.run_client(["sbatch", "-N", "2", "--ntasks-per-node", "2", ...])   # runs in node0
    slurm.stop(); mpipar.cluster.nodes.down(spec.name)

Everything else is the single-node cluster's (tests/slurm_cluster.py): one munged (its socket
is a path, which every network namespace reaches), the same settings, the same tear-down. Each
slurmd runs inside its node's namespaces (`slurmd -N nodeK`), so the job steps it starts see
that node's hostname, /dev/shm and link; the clients run inside node0, the only place from
which slurmctld's address on the bridge is reachable.
"""

from __future__ import annotations

import subprocess
import time

from slurm_cluster import (
    NODE_CPUS,
    SLURM_CONF,
    ClusterUnavailable,
    SlurmCluster,
    _terminate,
    _which,
)

from mpipar.cluster import nodes
from mpipar.cluster.spec import ClusterSpec

SLURMD_PORT = 6818
CTLD_PORT = 6817


class MultiNodeSlurm(SlurmCluster):
    _spec: ClusterSpec  # set by start(): the base class builds the instance inside start()

    @classmethod
    def start(cls, spec: ClusterSpec, timeout: float = 30.0) -> "MultiNodeSlurm":
        bound = type(cls.__name__, (cls,), {"_spec": spec})
        return super(cls, bound).start(timeout=timeout)

    @property
    def node_list(self) -> list[str]:
        return self._spec.node_names()

    def _write_conf(self) -> None:
        spec = self._spec
        names = self.node_list
        conf = SLURM_CONF.format(ctld_port=CTLD_PORT, slurmd_port=SLURMD_PORT,
                                 munge_socket=self.munge_socket, root=self.root, cpus=NODE_CPUS)
        conf = conf.replace("SlurmctldHost=localhost(127.0.0.1)",
                            f"SlurmctldHost=node0({spec.address('node0')})")
        # one pid file, spool and log per node (%n: the node's name)
        for key, value in (("SlurmdPidFile", "run/slurmd.%n.pid"),
                           ("SlurmdSpoolDir", "spool/%n"), ("SlurmdLogFile", "log/slurmd.%n.log")):
            conf = "\n".join(f"{key}={self.root}/{value}" if line.startswith(f"{key}=") else line
                             for line in conf.splitlines()) + "\n"
        lines = [line for line in conf.splitlines()
                 if not line.startswith(("NodeName=", "PartitionName="))]
        lines += [f"NodeName={n} NodeAddr={spec.address(n)} CPUs={NODE_CPUS} RealMemory=1000 "
                  "State=UNKNOWN" for n in names]
        lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        (self.root / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _in(self, node: str, argv: list[str]) -> list[str]:
        return nodes.enter_argv(self._spec, node) + argv

    def _start_slurm(self, timeout: float) -> None:
        conf = str(self.root / "slurm.conf")
        for n in self.node_list:
            (self.root / "spool" / n).mkdir(mode=0o755)
        starts = [("slurmctld", "node0", [_which("slurmctld"), "-f", conf, "-i"])]
        starts += [(f"slurmd.{n}", n, [_which("slurmd"), "-f", conf, "-N", n])
                   for n in self.node_list]
        for name, node, cmd in starts:
            proc = subprocess.run(self._in(node, cmd), capture_output=True, text=True,
                                  env=self.env, timeout=30)
            if proc.returncode != 0:
                raise ClusterUnavailable(f"{name} failed to start in {node}: "
                                         f"{proc.stderr.strip()}\n{self.log_tail(name)}")
            self.pids[name] = self._read_pid(name, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run_client(["sinfo", "-h", "-N", "-o", "%T"], check=False)
            states = out.stdout.split()
            if (out.returncode == 0 and len(states) == len(self.node_list)
                    and all(s in ("idle", "mixed", "allocated") for s in states)):
                return
            time.sleep(0.2)
        raise ClusterUnavailable(f"the nodes did not become idle within {timeout:.0f} s\n"
                                 f"{self.log_tail('slurmctld')}\n"
                                 f"{self.log_tail('slurmd.node1')}")

    def run_client(self, args: list[str], check: bool = True,
                   timeout: float = 30) -> subprocess.CompletedProcess:
        return super().run_client(self._in("node0", args), check=check, timeout=timeout)

    def stop(self) -> None:
        """Cancel the jobs while every slurmd still runs, stop the slurmds, then the rest as
        the single-node cluster does."""
        if self.pids.get("slurmctld"):
            self.run_client(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                q = self.run_client(["squeue", "-h", "-o", "%i"], check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.2)
        for name in [k for k in self.pids if k.startswith("slurmd.")]:
            _terminate(self.pids.pop(name))
        super().stop()
