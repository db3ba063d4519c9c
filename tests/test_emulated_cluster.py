"""The emulated cluster: clean up and down, bad input, MPI across nodes, where the bytes went.

Needs root, iproute2 with `ip netns`, and tc with the tbf qdisc; skips saying which is missing.
Every cluster made here has a name of its own (this process's id) and is torn down by a
fixture finaliser, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from emulated_util import leftovers, netns_inodes, processes_in, skip_reason
from mpi_util import ONE_THREAD, REPO
from spec_util import spec_text

from mpipar.analysis import load
from mpipar.cluster import nodes, probe
from mpipar.cluster.spec import ClusterError, ClusterSpec

pytestmark = [pytest.mark.slow, pytest.mark.mpi]
NAME = f"t{os.getpid() % 100000}"
TINY = REPO / "experiments" / "configs" / "tiny.toml"
GPT = ["--set", "model.n_layer=4", "--set", "model.n_embd=64", "--set", "model.n_head=4",
       "--set", "model.block_size=16", "--seq-len", "16", "--batch-size", "8",
       "--set", "train.eval_interval=0", "--quiet", "--dtype", "float64", "--steps", "4",
       "--dp", "2", "--pp", "2"]


REASON = skip_reason(NAME)
if REASON:
    pytestmark.append(pytest.mark.skip(reason=REASON))


def cli(*args, env=None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "mpipar.cli", "cluster", *args],
                          capture_output=True, text=True, env=full, timeout=120)


@pytest.fixture
def clean():
    yield
    inodes = netns_inodes(NAME)
    nodes.down(NAME)
    assert leftovers(NAME) == [] and processes_in(inodes) == []


def test_up_and_down_ten_times_leave_nothing(clean):
    for i in range(10):
        spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link="1gbit", shm_size="16m"))
        out = subprocess.run(nodes.enter_argv(spec, "node1") + [
            "sh", "-c", "hostname; stat -f -c %T /dev/shm; cat /proc/sys/kernel/random/boot_id;"
            " ip route"], capture_output=True, text=True, check=True).stdout.split("\n")
        assert out[0] == "node1" and out[1] == "tmpfs"
        assert "default" not in "\n".join(out[3:])  # no route out of the cluster
        assert leftovers(NAME) != []
        inodes = netns_inodes(NAME)
        assert len(inodes) == 3 and len(processes_in(inodes)) >= 2  # the two holders
        nodes.down(NAME)
        assert leftovers(NAME) == [], f"after down #{i + 1}"
        assert processes_in(inodes) == [], f"after down #{i + 1}"
    assert nodes.down(NAME) == []  # idempotent


def test_down_after_a_crash_finds_everything_by_its_name(clean):
    """The state file lost (a crash between making and recording): the prefix scan still
    finds the namespaces and the processes inside them."""
    nodes.up(ClusterSpec(name=NAME, nodes=3, link="200mbit", shm_size="16m"))
    inodes = netns_inodes(NAME)
    ClusterSpec(name=NAME).state_dir.joinpath("state.json").unlink()
    assert "is already up" in cli("up", "--name", NAME).stderr  # found by the prefix
    nodes.down(NAME)
    assert leftovers(NAME) == [] and processes_in(inodes) == []


@pytest.mark.parametrize("args, words", [
    (["--nodes", "9"], "--nodes 9: give 1 to 8 nodes"),
    (["--nodes", "0"], "--nodes 0"),
    (["--link", "fast"], "--link 'fast': give a rate as tc writes it"),
    (["--link", "500gbit"], "between 8kbit and 100gbit"),
    (["--shm-size", "lots"], "--shm-size 'lots'"),
    (["--cpus-per-node", "999"], "--cpus-per-node 999"),
])
def test_bad_input_is_one_line_and_makes_nothing(clean, args, words):
    proc = cli("up", "--name", NAME, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpipar cluster: error:") and words in lines[0]
    assert leftovers(NAME) == []


def test_the_launcher_names_a_node_whose_namespaces_are_gone(clean):
    """Hydra's launcher asked to start a proxy on a node that is gone says which, in one
    line (the node lost before the job reached it)."""
    spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link="1gbit", shm_size="16m"))
    pid = spec.holders["node1"]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)  # the holder is this process's child here (a CLI's `up` has exited)
    p = subprocess.run([str(spec.launcher), "-x", "node1", "true"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 255, p.stderr
    assert f"[mpipar] node1: its namespaces are gone (holder pid {pid} ended)" in p.stderr


def test_a_name_in_use_is_refused_and_the_cluster_kept(clean):
    assert cli("up", "--name", NAME, "--nodes", "2").returncode == 0
    proc = cli("up", "--name", NAME, "--nodes", "3")
    assert proc.returncode == 2 and "is already up" in proc.stderr
    status = cli("status", "--name", NAME)
    assert status.returncode == 0 and "node1" in status.stdout and "node2" not in status.stdout


def test_a_tc_that_refuses_leaves_nothing_half_made(clean, tmp_path):
    fake = tmp_path / "tc"
    fake.write_text("#!/bin/sh\necho 'Error: Invalid argument.' >&2\nexit 2\n")
    fake.chmod(0o755)
    proc = cli("up", "--name", NAME, "--nodes", "3",
               env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert proc.returncode == 2
    assert "tc refused the rate: Error: Invalid argument." in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert leftovers(NAME) == []


def test_no_root_and_missing_tools_are_said(clean, monkeypatch):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-m", "mpipar.cli", "cluster", "up", "--name", NAME],
                          capture_output=True, text=True, env={**os.environ,
                                                               "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "needs root" in proc.stderr, proc.stderr
    monkeypatch.setattr(nodes, "TOOLS", nodes.TOOLS + ("no-such-tool",))
    with pytest.raises(ClusterError, match="missing tools: no-such-tool"):
        nodes.up(ClusterSpec(name=NAME))
    assert leftovers(NAME) == []


# ----- MPI across two nodes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens):
    """One 2-node x 2-rank training run (counters around it, UCX's protocol tables on) and the
    same grid on one node."""
    tmp = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)}
    train = [sys.executable, "-m", "mpipar.cli", "train", "--config", TINY, "--data", tokens,
             *GPT]
    one = subprocess.run(["mpiexec", "-n", "4", *train, "--out", str(tmp / "one")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link="1gbit", shm_size="64m"))
    try:
        before = probe.counters(spec)
        two = subprocess.run(nodes.mpiexec_argv(spec, 2, train + ["--out", str(tmp / "two")]),
                             capture_output=True, text=True, timeout=300,
                             env={**env, **probe.PROTO_INFO_ENV})
        after = probe.counters(spec)
    finally:
        nodes.down(NAME)
    assert two.returncode == 0, two.stderr[-3000:]
    assert leftovers(NAME) == []
    return tmp, probe.delta(before, after), two.stdout + two.stderr  # UCX prints to stdout


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "metrics.json").read_text())["losses"]


def test_two_nodes_train_the_same_losses_as_one_node(runs):
    tmp, _, _ = runs
    assert losses(tmp / "two") == losses(tmp / "one")  # float64, bit for bit
    hosts = load(tmp / "two" / "trace.h5").attrs["hostnames"]
    assert hosts == ["node0", "node0", "node1", "node1"]


def dump_bytes(path: Path) -> tuple[int, int]:
    """(inter-node, intra-node) payload bytes the dump records as sent: point-to-point sends by
    the peer's host; a collective's contribution by whether its group spans hosts."""
    inter = intra = 0
    run = load(path)
    ranks = dict(enumerate(run.rank_attrs))
    host = {r: a["hostname"] for r, a in ranks.items()}
    for r, a in ranks.items():
        for ev in run.events[r]:
            kind = ev["kind"].decode() if isinstance(ev["kind"], bytes) else str(ev["kind"])
            if kind.endswith(".send"):
                across = host[int(ev["peer"])] != host[r]
            elif kind.startswith("dp.") and not kind.endswith(".wait"):
                group = [q for q, b in ranks.items() if b["pp"] == a["pp"]
                         and b["tp"] == a["tp"]]
                across = len({host[q] for q in group}) > 1
            else:
                continue
            if across:
                inter += int(ev["bytes"])
            else:
                intra += int(ev["bytes"])
    return inter, intra


def test_inter_node_bytes_cross_the_link_and_intra_node_bytes_do_not(runs):
    tmp, moved, ucx_log = runs
    inter, intra = dump_bytes(tmp / "two" / "trace.h5")
    # default order: the dp pairs share a node, the pipeline stages sit on different nodes
    assert inter > 100_000 and intra > 4 * inter
    sent = sum(m["tx"] for m in moved.values())
    # what the link carried: the pipeline's bytes plus headers, start-up and the dump's gather,
    # and far less than the gradients that stayed inside each node
    assert inter <= sent <= 2 * inter + 1_000_000, (inter, intra, moved)
    assert sent < intra / 2
    assert moved["node0"]["tx"] > 0.25 * sent and moved["node1"]["tx"] > 0.25 * sent
    used = probe.transports(ucx_log)
    assert used.get("inter-node") and all(t.startswith("tcp/") for t in used["inter-node"])
    assert used.get("intra-node") and not any(t.startswith("tcp/") for t in used["intra-node"])
    print(f"link carried {sent:,} B; dump: {inter:,} B inter-node, {intra:,} B intra-node; "
          f"transports {used}")


# ----- Slurm with one slurmd per node ------------------------------------------------------------

SLURM_NAME = f"s{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def slurm2():
    """Slurm over two emulated nodes, shared by the batch tests; everything removed after."""
    from slurm_cluster import ClusterUnavailable
    from slurm_multinode import MultiNodeSlurm

    spec = nodes.up(ClusterSpec(name=SLURM_NAME, nodes=2, link="1gbit", shm_size="64m"))
    slurm = None
    try:
        try:
            slurm = MultiNodeSlurm.start(spec)
        except ClusterUnavailable as exc:
            pytest.skip(f"no Slurm on the emulated nodes: {exc}")
        yield slurm
    finally:
        if slurm is not None:
            slurm.stop()
        nodes.down(SLURM_NAME)
        assert leftovers(SLURM_NAME) == []


def sbatch(slurm, root: Path, env: dict, *args, script: str = "train.sbatch",
           flags: tuple = ()) -> str:
    """Submit a checked-in script on 2 nodes x 2 tasks (inside node0); returns the job id."""
    env = {"CONFIG": str(TINY), "DP": "2", "PP": "2", "RUN_ROOT": str(root),
           "PYTHONPATH": str(REPO), **ONE_THREAD, **env}
    exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in env.items()])
    job = slurm.run_client(["sbatch", "--parsable", f"--export={exports}", "-N", "2",
                            "--ntasks-per-node", "2", "--ntasks", "4",
                            f"--output={root}/slurm-%j.out", *flags,
                            str(REPO / "slurm" / script), *map(str, args)])
    return job.stdout.strip().split(";")[0]


def wait_gone(slurm, job: str, timeout: float = 300) -> None:
    """Wait until the job has left the queue (requeued incarnations included)."""
    deadline = time.monotonic() + timeout
    while slurm.run_client(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout:.0f} s"
        time.sleep(0.5)


PMI2_FAULT = "mpi/pmi2: invalid client request"


def wait_gone_or_pmi2_fault(slurm, job: str, log: Path, timeout: float = 300,
                            grace: float = 30) -> None:
    """``wait_gone``, except that a job whose log shows the wheel's PMI-2 start-up fault
    (tests/test_slurm.py) and is still there ``grace`` seconds later is cancelled: the fault
    ends the job step in MPI_Init, or leaves its ranks blocked there until the job is killed."""
    deadline, seen = time.monotonic() + timeout, None
    while slurm.run_client(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip():
        now = time.monotonic()
        assert now < deadline, f"job {job} still queued after {timeout:.0f} s"
        if seen is None and log.is_file() and PMI2_FAULT in log.read_text(errors="replace"):
            seen = now
        if seen is not None and now - seen > grace:
            slurm.run_client(["scancel", job], check=False)
        time.sleep(0.5)


def test_sbatch_on_two_nodes_trains_the_losses_of_mpiexec_on_one(runs, slurm2, tokens,
                                                                  tmp_path):
    # The PyPI mpich wheel's PMI-2 start-up fault (tests/test_slurm.py): in MPI_Init, before
    # mpipar runs a line, the PMI-2 client sends slurmstepd a value that runs on into bytes of
    # its own heap (they decode to text of the docstrings loaded by then), so whether it hits
    # depends on what lies there, not on mpipar's code paths. It met this 2-node srun job on
    # every one of four attempts in some full-suite runs and on none in others. Up to four
    # attempts, each a fresh job; when all four meet it the srun launch across nodes cannot be
    # tested with this wheel here, which the skip says (any other failure fails the test).
    for _attempt in range(4):
        job = sbatch(slurm2, tmp_path, {}, "--data", tokens, *GPT)
        wait_gone_or_pmi2_fault(slurm2, job, tmp_path / f"slurm-{job}.out")
        log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
        if PMI2_FAULT not in log:
            break
    else:
        pytest.skip("the PyPI mpich wheel's PMI-2 start-up fault ended all four srun launches "
                    "in MPI_Init (slurmstepd: 'mpi/pmi2: invalid client request'); the "
                    "mpiexec launch across both nodes is tested by the sweep test")
    assert "finished with exit code 0" in log, log[-3000:]
    assert losses(tmp_path / job) == losses(runs[0] / "one")
    assert set(load(tmp_path / job / "trace.h5").attrs["hostnames"]) == {"node0", "node1"}


def test_a_sweep_array_runs_every_grid_across_both_nodes(slurm2, tokens, tmp_path):
    sweep = tmp_path / "grids.txt"
    sweep.write_text("dp=2 pp=2\ndp=4 pp=1 microbatches=2\n")
    job = sbatch(slurm2, tmp_path, {"LAUNCHER": "mpiexec", "SWEEP_FILE": str(sweep)},
                 "--data", tokens, *GPT[:-6], "--steps", 2, script="sweep.sbatch",
                 flags=("--array=0-1", "--output", f"{tmp_path}/slurm-%A_%a.out"))
    wait_gone(slurm2, job)
    for task, grid in ((0, (2, 2)), (1, (4, 1))):
        run_dir = tmp_path / f"{job}_{task}"
        log = (tmp_path / f"slurm-{job}_{task}.out").read_text(errors="replace")
        assert "finished with exit code 0" in log, log[-3000:]
        assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 2
        ranks = load(run_dir / "trace.h5").rank_attrs
        assert (max(a["dp"] for a in ranks) + 1, max(a["pp"] for a in ranks) + 1) == grid
        assert [a["hostname"] for a in ranks] == ["node0", "node0", "node1", "node1"]


def test_a_preempted_two_node_job_requeues_and_resumes_exactly(slurm2, tokens, tmp_path):
    """USR1 to the batch shell, as in tests/test_slurm.py, on a 2 x 2 job: every rank stops
    with a checkpoint, the job requeues itself and resumes to the losses of an uninterrupted
    run, bitwise in float64. Hydra inside the allocation (it starts node1's proxy by srun)."""
    steps = 30  # the signal comes after step 2's flush; the stop a step or two later
    args = ["--data", tokens, *GPT[:-6], "--set", "model.n_embd=16", "--steps", steps,
            "--set", "run.flush_interval=2"]
    job = sbatch(slurm2, tmp_path, {"LAUNCHER": "mpiexec"}, *args)
    run_dir, log_path = tmp_path / job, tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 300
    while not (run_dir / "trace.h5").exists():
        assert time.monotonic() < deadline, "the job never flushed its dump"
        time.sleep(0.1)
    slurm2.run_client(["scancel", "--signal=USR1", "--batch", job])
    wait_gone(slurm2, job)
    log = log_path.read_text(errors="replace")
    assert "finished with exit code 75" in log and "requeueing it" in log, log[-3000:]
    assert f"resumed from {run_dir}" in log and log.rstrip().endswith("exit code 0"), log[-3000:]
    stopped = int(log.split("stopped after step ")[1].split(",")[0])
    assert 2 <= stopped < steps
    ref = tmp_path / "one"
    subprocess.run(["mpiexec", "-n", "4", sys.executable, "-m", "mpipar.cli", "train",
                    "--config", str(TINY), *map(str, args), "--dp", "2", "--pp", "2",
                    "--out", str(ref)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    whole = json.loads((ref / "metrics.json").read_text())
    # float64, bitwise; metrics.json of the resumed run keeps its predecessor's steps too
    assert losses(run_dir) == whole["losses"] and len(whole["losses"]) == steps


# ----- faults across nodes -----------------------------------------------------------------------

WATCHDOG_S = 15


@pytest.mark.parametrize("fault", ["node lost", "link down"])
def test_a_lost_node_or_link_ends_the_job_in_time_and_the_dump_stays_readable(
        fault, tokens, tmp_path, clean):
    from mpipar.analysis import load

    spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link="1gbit", shm_size="64m"))
    out = tmp_path / "run"
    cmd = nodes.mpiexec_argv(spec, 2, [
        sys.executable, "-m", "mpipar.cli", "train", "--config", str(TINY), "--data", tokens,
        *GPT[:-6], "--dp", "2", "--pp", "2", "--steps", "100000", "--set",
        "run.flush_interval=2", "--set", f"run.watchdog_s={WATCHDOG_S}", "--out", str(out)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "trace.h5").exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run wrote no dump"
            time.sleep(0.2)
        time.sleep(1)
        t0 = time.monotonic()
        if fault == "node lost":
            assert nodes.kill_node(spec, "node1")
        else:
            nodes.set_link(spec, "node1", up=False)
        output = proc.communicate(timeout=WATCHDOG_S + 60)[0]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    print(f"--- {fault}: exit {proc.returncode} after {took:.0f} s ---\n{output[-3000:]}")
    assert proc.returncode != 0
    assert took < WATCHDOG_S + 10, f"the job took {took:.0f} s to end after the {fault}"
    ours = [line for line in output.splitlines() if line.startswith("[mpipar]")]
    if fault == "link down":
        # only node0's ranks still reach the launcher: the first watchdog to fire there (two
        # stage-0 ranks waiting alike may fire together) names node1: a pipeline wait names
        # the rank it waits for there and its host; a rank in the step's world all-reduce
        # names the hosts that collective spans (it waits 1.5 s longer but can still win).
        assert ours, output[-2000:]
        for line in ours:
            assert "(host node0) failed: no progress" in line, ours
            if "waiting for rank" in line:
                assert "(host node1, pipeline stage" in line, ours
                assert "stopped answering: node lost or link down between node0" in line, ours
            else:
                assert "blocked in the gradient-norm (and loss) all-reduce" in line, ours
                assert ("over hosts node0, node1, which stopped: node lost or link down "
                        "between node0 and node1?") in line, ours
    else:
        # Hydra's proxy on node1 dies with the ranks: mpiexec sees its control connection close
        # and kills every rank at once, before any survivor can speak; the cluster's launcher
        # on node0, the proxy's parent, names the host (Hydra's own line does not; the two
        # race, the launcher's came first in every run seen).
        assert proc.returncode == 255, output[-2000:]
        lost = "[mpipar] node1: the MPI proxy on this host was killed (signal 9): node lost?"
        assert lost in ours, output[-2000:]
        assert "[mpiexec@node0] control_cb" in output and "assert (!closed) failed" in output
        assert "    2   0   1   0  node1" in output, output[-2000:]
    run = load(out / "trace.h5")
    assert run.world_size == 4 and not run.complete and len(run.events[0]) > 0


def test_multinode_experiment_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "multinode.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    with h5py.File(tmp_path / "multinode.h5") as f:
        assert set(f) == {"inside", "link-1gbit"}
        assert f["link-1gbit"].attrs["hosts"] == "node0,node1"
        assert f["inside"].attrs["hosts"] == "node0,node0"
        assert (f["link-1gbit/median_s"][()] > 0).all()
    assert (tmp_path / "multinode.png").stat().st_size > 0
    assert leftovers("mnx") == [] and leftovers("mnxt") == []
    rows = {r["run"]: r for r in json.loads((tmp_path / "train" / "results.json").read_text())
            ["rows"]}
    assert set(rows) == {"tp-inside@1gbit", "tp-across@1gbit", "dp-1node", "dp-2nodes@1gbit"}
    assert all(r["step ms"] > 0 and r["bucket wait ms"] >= 0 for r in rows.values())
    # the order decides which axis crosses the link; one node keeps every byte inside
    inside, across = rows["tp-inside@1gbit"], rows["tp-across@1gbit"]
    assert inside["tp across KB"] == 0 < inside["tp within KB"]
    assert inside["dp across KB"] > 0 == inside["dp within KB"]
    assert across["tp within KB"] == 0 < across["tp across KB"]
    assert across["dp within KB"] > 0 == across["dp across KB"]
    assert rows["dp-1node"]["dp across KB"] == 0 < rows["dp-1node"]["dp within KB"]
    assert rows["dp-2nodes@1gbit"]["dp within KB"] == 0 < rows["dp-2nodes@1gbit"]["dp across KB"]


def test_a_token_file_on_one_node_only_is_refused_naming_the_host_and_path(tokens, tmp_path,
                                                                           clean):
    """The file sits in node0's private /dev/shm: node1's ranks cannot open it, and the job
    stops before step 1 with one line that names node1 and the path."""
    spec = nodes.up(ClusterSpec(name=NAME, nodes=2, link="1gbit", shm_size="64m"))
    local = "/dev/shm/only-here.h5"
    copy = subprocess.run(nodes.enter_argv(spec, "node0") + ["cp", tokens, local],
                          capture_output=True, text=True)
    assert copy.returncode == 0, copy.stderr
    assert not os.path.exists(local)  # private to node0, not on this machine either
    out = tmp_path / "run"
    proc = subprocess.run(nodes.mpiexec_argv(spec, 2, [
        sys.executable, "-m", "mpipar.cli", "train", "--config", str(TINY), "--data", local,
        *GPT, "--out", str(out)]), capture_output=True, text=True, timeout=180,
        env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    nodes.down(NAME)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, said
    assert len(said) == 1, said
    assert ("rank 2 (host node1): token file /dev/shm/only-here.h5 does not exist on this host"
            in said[0]), said
    assert "filesystem every node sees" in said[0] and "node0" not in said[0], said
    assert not (out / "trace.h5").exists() and not (out / "metrics.json").exists()


def test_a_message_below_the_old_bucket_crosses_at_the_link_rate(clean):
    """tbf passes what its bucket holds at once. A bucket of 1 ms at the rate (64 KiB at
    200 Mbit/s) let a 64 KiB message, the tiny GPT's micro-batch activation, cross at about
    twice the rate (1.39 ms one way against 2.62 at the rate); the 3.75 KB bucket of
    ``tbf_burst_bytes`` keeps it near the rate. Load only slows a message, so a loaded
    machine cannot make this fail."""
    from mpipar.plan.measure import commbench_tables

    nodes.up(ClusterSpec(name=NAME, nodes=2, link="200mbit", shm_size="256m"))
    p2p, _ = commbench_tables(2, True, False, 120, NAME, "8,64K")
    one_way = float(p2p[p2p["bytes"] == 65536]["comm_s"][0])
    assert one_way >= 0.8 * 65536 / 25e6, f"64 KiB crossed in {one_way * 1e3:.2f} ms"


def test_plan_here_emulated_quick(tmp_path):
    """experiments/plan_here.py --emulated --quick: the cluster up at one rate, the link
    measured there, each row run on both nodes and planned with that link over the machine's
    samples; nothing left."""
    spec = tmp_path / "cpu.toml"
    spec.write_text(CPU_SPEC)
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "plan_here.py"), "--quick",
                           "--emulated", "--repeats", "1", "--spec", str(spec),
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600,
                          env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert leftovers("mpph") == []
    doc = json.loads((tmp_path / "emulated" / "results.json").read_text())
    assert [(r["table"], r["grid"]) for r in doc["rows"]] == [
        ("2 nodes @1gbit", "2x1x1"), ("2 nodes @1gbit", "1x2x1")]
    assert all(r["step_ms"] > 0 and r["planned_ms"] > 0 for r in doc["rows"])
    # the machine sampled beside the runs, before the round and after it, as in tables 1-2
    assert len(list((tmp_path / "emulated" / "1gbit" / "specs").glob("sample-*.toml"))) == 2
    assert all(r["band_lo_ms"] <= r["near_ms"] <= r["band_hi_ms"] for r in doc["rows"])
    link = doc["meta"]["links"]["1gbit"]
    assert link["latency_us"] > 0 and 0 < link["bandwidth_mbs"] < 200  # 1 Gbit/s = 125 MB/s


CPU_SPEC = spec_text(name="cpu", gpus_per_node=2, top="cores_per_node = 2\n",
                     workspace_gb=0.05, fp32=0.1, hbm_gbs=20.0, intra=(5.0, 5.0),
                     inter=(5.0, 5.0), half_dim=20.0)
