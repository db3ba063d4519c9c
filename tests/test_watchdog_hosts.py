"""The watchdog's line for a rank stalled in a collective names the hosts the collective spans
(``mpi/job/watchdog.py``): the grid tells it each group's hosts (``know_hosts``)."""

from types import SimpleNamespace

import pytest

from mpipar.mpi.job import watchdog


@pytest.fixture
def on_node0(monkeypatch):
    monkeypatch.setattr(watchdog.socket, "gethostname", lambda: "node0")
    watchdog.know_hosts({"world": ["node0", "node0", "node1", "node1"],
                         "dp": ["node0", "node0"], "tp": ["node0", "node1"]})
    yield
    watchdog.know_hosts({})


def state(what):
    return SimpleNamespace(what=what, peer_of=None, step=3)


def test_a_world_all_reduce_names_every_host_and_the_link(on_node0):
    line = watchdog._spans(state("the gradient-norm (and loss) all-reduce and the optimizer step"))
    assert line == (", over hosts node0, node1, which stopped: node lost or link down between "
                    "node0 and node1?")


def test_a_group_inside_one_node_names_that_host_only(on_node0):
    line = watchdog._spans(state("the data-parallel gradient all-reduce"))
    assert line == ", over host node0 only, which stopped: is a rank on it stuck?"


def test_no_hosts_line_for_other_work_or_unknown_groups(on_node0):
    assert watchdog._spans(state("a checkpoint write")) == ""
    action = SimpleNamespace(is_comm=True, __str__=lambda self: "all-reduce")
    assert watchdog._spans(state(action)) == ""  # a pipeline action names its peer instead
    watchdog.know_hosts({})
    assert watchdog._spans(state("the loss all-reduce")) == ""  # no grid: nothing to name
