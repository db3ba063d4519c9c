"""Node-aware collectives (``mpipar/mpi/hierarchical.py``), the topology a collectives table
carries, and where the ranks are (``grid.placement_warning``).

One machine looks like several nodes to MPICH when Hydra is given several host names for it
(``-launcher fork -hosts nodeA:2,nodeB:2``): ``Split_type(COMM_TYPE_SHARED)`` then splits the
ranks by those names, which is all the node-aware paths ask of a node.
"""

import json
import os
import subprocess
import sys

import pytest
from mpi_util import MPI_DIR, REPO, run_mpi

from mpipar.mpi import tuning
from mpipar.mpi.grid import node_labels, placement_warning
from mpipar.mpi.hierarchical import topology


def on_nodes(n, hosts, script, *args, **kw):
    """``mpiexec -n N -launcher fork -hosts HOSTS python tests/mpi/SCRIPT args``."""
    return run_mpi(n, ["-launcher", "fork", "-hosts", hosts, sys.executable,
                       MPI_DIR / script, *args], **kw)


@pytest.mark.mpi
@pytest.mark.parametrize("n, hosts", [(4, "nodeA:2,nodeB:2"), (4, "nodeA:1,nodeB:1"),
                                      (6, "nodeA:3,nodeB:3"), (3, "nodeA:2,nodeB:1"),
                                      (5, "nodeA:2,nodeB:1,nodeC:2")],
                         ids=["2x2", "alternating", "2x3", "2-nodes-uneven", "3-nodes-uneven"])
def test_hier_collectives_under_mpiexec(n, hosts):
    """All-reduce and reduce-scatter, float64 and float32, sizes not divisible by the ranks,
    blocking and non-blocking: the same bits on every rank and the flat sum within rounding
    (on two nodes, the bits of the two node sums added, by either path: pairs or leaders);
    auto's choice; the grid's nodes and placement lines."""
    p = on_nodes(n, hosts, "coll_hier.py", timeout=240, check=True,
                 env={"MPIPAR_COLLECTIVES_TABLE": "/nonexistent"})
    assert p.stdout.count("coll_hier OK") == n, p.stdout


@pytest.mark.mpi
def test_dp4_on_two_nodes_matches_one_rank(tokens):
    """dp = 4 on 2 nodes x 2 ranks, every gradient all-reduce (and ZeRO-1's reduce-scatter)
    forced through the node-aware path, the buckets registered in each node's window:
    float64 gradients and weights equal one rank's."""
    variants = ["1f1b:2", "gpipe:2:zero1", "zb-h1:2"]
    res = on_nodes(4, "nodeA:2,nodeB:2", "equiv_train.py", tokens, 4, 1, 1, *variants,
                   timeout=300, env={"MPIPAR_COLLECTIVES": "hier",
                                     "MPIPAR_COLLECTIVES_TABLE": "/nonexistent"})
    report = "\n".join(line for line in res.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))
    assert res.returncode == 0, f"{report}\n{res.stderr[-3000:]}"
    assert report.count("ok  ") == len(variants), report


def test_choice_offers_hier_only_across_nodes():
    big = 16 << 20
    across = {"shm": False, "hier": True}  # what Comm.algorithm asks where the ranks span nodes
    assert tuning.choose("allreduce", big, 4, tuned={}) == "shm"  # one node: the default view
    assert tuning.choose("allreduce", big, 4, tuned={}, **across) == "hier"
    assert tuning.choose("allreduce", big, 4, tuned={}, shm=False) == "library"
    assert tuning.choose("allreduce", 4096, 4, tuned={}, **across) == "library"
    assert tuning.choose("reduce_scatter", big, 4, tuned={}, **across) == "hier"
    assert tuning.choose("allgather", big, 4, tuned={}, **across) == "library"
    # two ranks across nodes: one per node, halves as before
    assert tuning.choose("allreduce", big, 2, tuned={}, shm=False) == "rabenseifner"
    # a tuned table that chose hier: where it cannot run, the defaults without it decide
    table = tuning.validate(tuning.tuned_table(
        {"allreduce": {4: [(big, {"library": 3.0, "ring": 2.0, "hier": 1.0})]}}, "mpich"))
    assert tuning.choose("allreduce", big, 4, tuned=table, **across) == "hier"
    assert tuning.choose("allreduce", big, 4, tuned=table) == "shm"


def test_topology_of_a_job():
    t = topology([0, 0, 1, 1], link="1gbit")
    assert t == {"nodes": 2, "ranks_per_node": [2, 2], "link": "1gbit"}
    assert tuning.describe_topology(t) == "2 node(s), ranks per node 2 x 2, link 1gbit"
    assert topology([0, 1, 0])["ranks_per_node"] == [2, 1]


def test_table_tuned_on_another_topology_is_ignored(tmp_path):
    """A table carries the topology it was tuned on; a job on another one takes the defaults
    and says so in one line; one without a topology counts as tuned on one node."""
    two = topology([0, 0, 1, 1], link="1gbit")
    data = tuning.tuned_table({"allreduce": {4: [(1 << 20, {"library": 2.0, "ring": 1.0})]}},
                              "mpich", two)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert tuning.load(path, two)["allreduce"][4] == [(1 << 20, "ring")]
    assert tuning.load(path)["allreduce"][4] == [(1 << 20, "ring")]  # topology not known
    assert tuning.load(path, topology([0, 0, 1, 1], link="200mbit")) == {}
    assert tuning.load(path, topology([0, 0, 0, 0])) == {}
    del data["topology"]
    path.write_text(json.dumps(data))
    assert tuning.load(path, topology([0, 0, 0, 0], link="x"))  # tuned on one node: applies
    assert tuning.load(path, two) == {}


def test_ignoring_a_table_says_why_in_one_line(tmp_path):
    data = tuning.tuned_table({"allreduce": {4: [(1 << 20, {"library": 2.0, "ring": 1.0})]}},
                              "mpich", topology([0, 0, 0, 0], link="unknown"))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    code = ("from mpipar.mpi import tuning, hierarchical as h\n"
            "tuning.use_topology(h.topology([0, 0, 1, 1], link='1gbit'), 0)\n"
            "assert tuning.table() == {}\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"MPIPAR_COLLECTIVES_TABLE": str(path), "PYTHONPATH": str(REPO)},
                         timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tuned on 1 node(s)" in lines[0] and "2 node(s)" in lines[0]
    assert "commbench --tune" in lines[0]


def test_placement_warning_names_the_group_hosts_and_the_order():
    hosts = ["a", "a", "b", "b"]
    # dp-tp-pp puts tp pairs (0, 2) and (1, 3) across the two hosts
    warn = placement_warning(2, 1, 2, "dp-tp-pp", [0, 0, 1, 1], hosts)
    assert "tp group of world ranks 0,2 spans hosts a, b" in warn
    assert 'parallel.order = "tp-dp-pp"' in warn and "\n" not in warn
    assert placement_warning(2, 1, 2, "tp-dp-pp", [0, 0, 1, 1], hosts) is None
    # ranks alternating between nodes: the order that keeps tp inside one is not the default
    warn = placement_warning(2, 1, 2, "tp-dp-pp", [0, 1, 0, 1], ["a", "b", "a", "b"])
    assert "parallel.order" in warn and 'order = "tp-dp-pp"' not in warn
    warn = placement_warning(1, 1, 4, "tp-dp-pp", [0, 0, 1, 1], hosts)
    assert "no parallel.order keeps tp = 4 inside a node" in warn
    assert placement_warning(4, 1, 1, "tp-dp-pp", [0, 0, 1, 1], hosts) is None


def test_node_labels_tell_nodes_apart_when_host_names_do_not():
    assert node_labels([0, 0, 1, 1], ["n0", "n0", "n1", "n1"]) == ["n0", "n1"]
    assert node_labels([0, 1, 0, 1], ["vm"] * 4) == ["node0 (vm)", "node1 (vm)"]


@pytest.mark.mpi
def test_train_across_nodes_warns_and_analyze_shows_links(tokens, tmp_path):
    """`mpipar train` on 2 nodes prints the grid with its nodes and one warning for tp groups
    across them; `mpipar analyze` then puts tp's bytes in the across-nodes column (the dump's
    host names set to what two real nodes would write: here one machine has one name)."""
    import h5py
    from mpi_util import SMALL_GPT

    out = tmp_path / "run"
    train = [sys.executable, "-m", "mpipar.cli", "train", "--data", tokens, "--out", str(out),
             *[a for a in SMALL_GPT if a != "--quiet"], "--steps", "2", "--dp", "2", "--tp", "2",
             "--set", "parallel.order=dp-tp-pp", "--set", "run.progress=false"]
    p = run_mpi(4, ["-launcher", "fork", "-hosts", "nodeA:2,nodeB:2", *train], timeout=240,
                check=True)
    warnings = [line for line in p.stdout.splitlines() if "warning: tp group" in line]
    assert len(warnings) == 1 and 'parallel.order = "tp-dp-pp"' in warnings[0], p.stdout
    assert "grid dp=2 pp=1 tp=2 order=dp-tp-pp" in p.stdout and "node1 (" in p.stdout
    for r, host in enumerate(["n0", "n0", "n1", "n1"]):  # each rank's part holds its host
        with h5py.File(out / "trace.parts" / f"rank-{r:05d}.h5", "r+") as f:
            f.attrs["hostname"] = host
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "analyze", str(out)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    assert "bytes per link class on 2 hosts" in res.stdout, res.stdout
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()
            if line.startswith("  ") and line.split()[:1] in (["tp"], ["dp"])}
    assert float(rows["tp"][0]) == 0 and float(rows["tp"][1]) > 0, res.stdout  # across
    assert float(rows["dp"][1]) == 0 and float(rows["dp"][0]) > 0, res.stdout  # within


@pytest.mark.mpi
def test_hier_allreduce_experiment_quick(tmp_path):
    """experiments/hier_allreduce.py --quick on one machine taken for 2 nodes x 2 ranks: every
    size has library, hier and auto times, and the topology it ran on is recorded."""
    res = subprocess.run([sys.executable, str(REPO / "experiments" / "hier_allreduce.py"),
                          "--quick", "--link", "test", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPIPAR_COLLECTIVES_TABLE": "/nonexistent"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["topology"] == {"nodes": 2, "ranks_per_node": [2, 2], "link": "test"}
    assert [r["bytes"] for r in doc["rows"]] == [1024, 65536, 2 << 20]
    for r in doc["rows"]:
        assert r["library_us"] > 0 and r["hier_us"] > 0 and r["auto_us"] > 0, r
    assert doc["rows"][-1]["choice"] == "hier" and doc["rows"][0]["choice"] == "library"
