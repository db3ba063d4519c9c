"""``mpipar.plan.placement``: which axes' groups span nodes, and the planner pricing those
axes on the inter-node link."""

from __future__ import annotations

import dataclasses

import pytest
from spec_util import spec_text

from mpipar.mpi.grid import groups_across_nodes, orders
from mpipar.plan import PlanError, load_cluster
from mpipar.plan.here import planned
from mpipar.plan.placement import axis_links, crossing, spans_nodes

SPEC = spec_text(gpus_per_node=2, intra=(10.0, 5.0), inter=(0.025, 50.0))
GPT = {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 32, "n_layer": 2,
                 "n_embd": 32, "n_head": 2},
       "train": {"batch_size": 8, "seq_len": 32, "dtype": "float32"},
       "parallel": {"schedule": "1f1b", "microbatches": 2}}


def _cluster(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return load_cluster(str(path))


def test_dp2_tp2_on_two_nodes_spans_the_axis_the_order_puts_last():
    grid = {"dp": 2, "pp": 1, "tp": 2}
    assert spans_nodes(grid, 2, "tp-dp-pp") == {"dp": True, "pp": False, "tp": False}
    assert spans_nodes(grid, 2, "dp-tp-pp") == {"dp": False, "pp": False, "tp": True}
    assert spans_nodes({**grid, "order": "dp-tp-pp"}, 2)["tp"]  # the grid's own order
    assert not any(spans_nodes(grid, None, "dp-tp-pp").values())  # one node
    assert not any(spans_nodes(grid, 4, "dp-tp-pp").values())
    assert spans_nodes(grid, 1, "tp-dp-pp") == {"dp": True, "pp": False, "tp": True}


@pytest.mark.parametrize("order", orders())
def test_spans_agree_with_the_grids_own_check(order):
    """The planner's answer is the runtime's (``grid.groups_across_nodes``) for every order."""
    for rpn in (1, 2, 4):
        node_of = [r // rpn for r in range(8)]
        want = {a: bool(groups_across_nodes(2, 2, 2, a, order, node_of))
                for a in ("dp", "pp", "tp")}
        assert spans_nodes({"dp": 2, "pp": 2, "tp": 2}, rpn, order) == want


def test_bad_placement_is_one_plan_error():
    with pytest.raises(PlanError, match="ranks per node"):
        spans_nodes({"dp": 2, "tp": 2}, 0, "tp-dp-pp")
    with pytest.raises(PlanError, match="placement"):
        spans_nodes({"dp": 2, "tp": 2}, 2, "tp-dp")


def test_links_follow_the_placement(tmp_path):
    c = _cluster(tmp_path)
    across = axis_links(c, {"dp": 2, "tp": 2}, 2, "dp-tp-pp")
    assert across["tp"] == c.inter and across["dp"] == c.intra and across["pp"] == c.intra
    assert across["world"] == c.inter
    one = axis_links(c, {"dp": 2, "tp": 2}, None, "dp-tp-pp")
    assert all(link == c.intra for link in one.values())


def test_tp_across_nodes_plans_slower_than_tp_inside(tmp_path):
    """dp=2 x tp=2 on 2 nodes: with the inter-node link slower, tp across (dp-tp-pp) plans a
    longer step than tp inside (tp-dp-pp): tp all-reduces every block, dp once a step; with the
    inter-node link equal to the intra-node one the two placements plan the same step."""
    c = _cluster(tmp_path)
    grid = {"dp": 2, "pp": 1, "tp": 2}
    inside = planned(GPT, {**grid, "order": "tp-dp-pp"}, c, ranks_per_node=2)
    across = planned(GPT, {**grid, "order": "dp-tp-pp"}, c, ranks_per_node=2)
    alone = planned(GPT, {**grid, "order": "dp-tp-pp"}, c)  # one node
    assert across["step"] > inside["step"] > alone["step"]
    same = dataclasses.replace(c, inter=c.intra)
    assert planned(GPT, {**grid, "order": "dp-tp-pp"}, same, ranks_per_node=2)["step"] == \
        pytest.approx(planned(GPT, {**grid, "order": "tp-dp-pp"}, same, ranks_per_node=2)["step"])
    # the order also comes from the config's parallel.order
    cfg = {**GPT, "parallel": {**GPT["parallel"], "order": "dp-tp-pp"}}
    assert planned(cfg, grid, c, ranks_per_node=2)["step"] == pytest.approx(across["step"])


def test_the_ranks_that_cross_at_once_per_axis():
    """A node's ranks that leave it at once: every rank of a spanning tp / dp group, for pp the
    two ends of a stage boundary between nodes only, every rank for the world's all-reduce."""
    assert crossing({"dp": 2, "pp": 2, "tp": 1}, 2) == {"dp": 0, "pp": 2, "tp": 0, "world": 2}
    assert crossing({"dp": 1, "pp": 4, "tp": 1}, 2)["pp"] == 1  # one boundary of three crosses
    assert crossing({"dp": 2, "pp": 1, "tp": 2}, 2, "tp-dp-pp")["dp"] == 2
    assert crossing({"dp": 2, "pp": 1, "tp": 2}, 2, "dp-tp-pp")["tp"] == 2
    assert crossing({"dp": 2, "pp": 1, "tp": 1}, 1) == {"dp": 1, "pp": 0, "tp": 0, "world": 1}
    assert set(crossing({"dp": 2, "pp": 2, "tp": 1}, None).values()) == {0}  # one node


def test_one_link_per_node_is_shared_by_the_ranks_that_cross(tmp_path):
    """nics_per_node 1 (a node's one link): two pipelines crossing the same link at once get
    half its bandwidth each, so dp=2 x pp=2 on 2 nodes x 2 ranks plans longer than with a link
    per rank; one rank per node, or a link per rank (the DGX specs, nics 0), is unchanged."""
    c = _cluster(tmp_path)
    one = dataclasses.replace(c, nics_per_node=1)
    links = axis_links(one, {"dp": 2, "pp": 2, "tp": 1}, 2)
    assert links["pp"].bandwidth == pytest.approx(c.inter.bandwidth / 2)
    assert axis_links(c, {"dp": 2, "pp": 2, "tp": 1}, 2)["pp"] == c.inter
    grid = {"dp": 2, "pp": 2, "tp": 1}
    assert planned(GPT, grid, one, ranks_per_node=2)["step"] > \
        planned(GPT, grid, c, ranks_per_node=2)["step"]
    pipe = {"dp": 1, "pp": 2, "tp": 1}
    assert planned(GPT, pipe, one, ranks_per_node=1)["step"] == \
        pytest.approx(planned(GPT, pipe, c, ranks_per_node=1)["step"])


def test_nics_per_node_is_read_and_checked(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.replace("[inter_node]\n", "[inter_node]\nnics_per_node = 1\n"))
    assert load_cluster(str(path)).nics_per_node == 1
    assert _cluster(tmp_path).nics_per_node == 0  # absent: a link per GPU
    assert load_cluster("dgx-a100-80gb").nics_per_node == 0
    for bad in ("-1", "1.5", "true"):
        path.write_text(SPEC.replace("[inter_node]\n", f"[inter_node]\nnics_per_node = {bad}\n"))
        with pytest.raises(PlanError, match="nics_per_node must be a whole number"):
            load_cluster(str(path))
    with pytest.raises(PlanError, match="ranks per node"):  # one clear error, not a division
        crossing({"dp": 2, "pp": 2}, 0)
    with pytest.raises(PlanError, match="placement"):
        crossing({"dp": 2, "tp": 2}, 2, "tp-dp")


def test_ranks_sharing_one_core_do_not_cross_at_once(tmp_path):
    """A node with one core runs one of its ranks at a time: its link is not split between
    them (the emulated cluster's nodes); with a core per rank it is."""
    c = dataclasses.replace(_cluster(tmp_path), nics_per_node=1)
    grid = {"dp": 2, "pp": 2, "tp": 1}
    assert axis_links(dataclasses.replace(c, cores_per_node=1), grid, 2)["pp"] == c.inter
    halved = axis_links(dataclasses.replace(c, cores_per_node=2), grid, 2)["pp"]
    assert halved.bandwidth == pytest.approx(c.inter.bandwidth / 2)
