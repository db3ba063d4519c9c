"""A real single-node Slurm cluster on localhost, for tests: munged + slurmctld + slurmd.

Uses Debian's packages (slurm/install_slurm.sh installs them). Everything lives in one temporary
directory: config, munge key and socket, state, spool, pid and log files, so nothing touches
/etc or /var and two clusters (e.g. two pytest sessions) can run side by side on their own ports.

    cluster = SlurmCluster.start()      # raises ClusterUnavailable with the reason if it cannot
    subprocess.run(["sbatch", ...], env=cluster.env)
    cluster.stop()                      # cancels jobs, stops daemons by pid, removes the directory

Facts this relies on (measured on a 2-core Debian 12 container, Slurm 22.05, no systemd):
- munged checks that every parent of its socket is world-executable and not group/other
  writable (sticky /tmp is fine), so the temp dir is chmod 755.
- The node declares CPUs=8 (with SlurmdParameters=config_overrides) so that 4- and 8-rank jobs
  start on 2 real cores; MpiDefault=pmi2 lets the PyPI mpich wire up a world under srun.
- No accounting daemon: job state comes from `scontrol show job` / `squeue -t all`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NODE_CPUS = 8  # declared, not real: lets 8-rank jobs start on a 2-core machine
INSTALL_SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "install_slurm.sh"


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be brought up here (not root, packages missing, daemon failed)."""


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which is not always on a non-root PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed(install: bool = True) -> None:
    """Raise ClusterUnavailable unless daemons and clients are present (installs if allowed)."""
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing and install and os.geteuid() == 0 and INSTALL_SCRIPT.exists():
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"install_slurm.sh failed: {proc.stderr.strip()[-500:]}")
        missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing:
        why = "not root" if os.geteuid() != 0 else "install failed or disabled"
        raise ClusterUnavailable(f"Slurm/munge programs missing ({', '.join(missing)}; {why}); "
                                 "run slurm/install_slurm.sh as root")
    if os.geteuid() != 0:
        # slurmd must run as root to launch job steps as the submitting user.
        raise ClusterUnavailable("a local Slurm cluster needs root (slurmd runs as root)")


SLURM_CONF = """\
ClusterName=mpipartest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=2
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)

    # ---- bring-up -------------------------------------------------------------------------
    @classmethod
    def start(cls, timeout: float = 30.0, install: bool = True) -> "SlurmCluster":
        ensure_installed(install)
        root = Path(tempfile.mkdtemp(prefix="mpipar-slurm-"))
        os.chmod(root, 0o755)  # munged: every parent of its socket must be world-executable
        for sub in ("state", "spool", "run", "log", "munge", "jobs"):
            (root / sub).mkdir(mode=0o755)
        env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        for var in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":
                del env[var]  # a test running inside a real allocation must not leak into ours
        cluster = cls(root=root, env=env)
        try:
            cluster._start_munge()
            cluster._write_conf()
            cluster._start_slurm(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.munge_socket = self.root / "munge" / "munge.socket"
        cmd = [_which("munged"), "--force", f"--socket={self.munge_socket}",
               f"--key-file={key}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
               f"--log-file={self.root / 'log' / 'munged.log'}",
               f"--seed-file={self.root / 'munge' / 'munged.seed'}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"munged failed: {proc.stderr.strip()}")
        self.pids["munged"] = self._read_pid("munged", timeout=5)

    def _write_conf(self) -> None:
        conf = SLURM_CONF.format(ctld_port=_free_port(), slurmd_port=_free_port(),
                                 munge_socket=self.munge_socket, root=self.root, cpus=NODE_CPUS)
        (self.root / "slurm.conf").write_text(conf)

    def _start_slurm(self, timeout: float) -> None:
        conf = str(self.root / "slurm.conf")
        # Without systemd the daemons fork into the background themselves; -i ignores old state.
        for name, cmd in (("slurmctld", [_which("slurmctld"), "-f", conf, "-i"]),
                          ("slurmd", [_which("slurmd"), "-f", conf, "-N", "localhost"])):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=30)
            if proc.returncode != 0:
                raise ClusterUnavailable(f"{name} failed to start: {proc.stderr.strip()}\n"
                                         f"{self.log_tail(name)}")
            self.pids[name] = self._read_pid(name, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run_client(["sinfo", "-h", "-N", "-o", "%T"], check=False)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise ClusterUnavailable(f"node did not become idle within {timeout:.0f} s\n"
                                 f"{self.log_tail('slurmctld')}\n{self.log_tail('slurmd')}")

    def _read_pid(self, name: str, timeout: float) -> int:
        pidfile = self.root / "run" / f"{name}.pid"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return int(pidfile.read_text().split()[0])
            except (FileNotFoundError, ValueError, IndexError):
                time.sleep(0.05)
        raise ClusterUnavailable(f"{name} wrote no pid file\n{self.log_tail(name)}")

    # ---- use ------------------------------------------------------------------------------
    def run_client(self, args: list[str], check: bool = True,
                   timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / "log" / f"{name}.log"
        if not path.exists():
            return f"({path} missing)"
        return f"--- {path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ---- tear-down ------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, stop the daemons by pid (slurmd, slurmctld, munged), remove files."""
        if self.pids.get("slurmctld"):
            self.run_client(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # give steps a moment to die before slurmd goes
                q = self.run_client(["squeue", "-h", "-o", "%i"], check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid:
                _terminate(pid)
        shutil.rmtree(self.root, ignore_errors=True)


def _terminate(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped by a lazy init) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
