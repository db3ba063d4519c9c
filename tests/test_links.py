"""Bytes per link class (within a node / across nodes) per axis (``analysis/links.py``)."""

import json

from mpipar.analysis import synthetic as syn
from mpipar.analysis.links import link_bytes, links_text


def dump(tmp_path, hosts):
    """dp = 2 x tp = 2 (order tp-pp-dp: tp pairs (0, 1) and (2, 3)), one step: a tp all-reduce
    of 100 bytes and a dp all-reduce of 1000 bytes (posted, then waited) on every rank, and a
    world all-reduce of 8 bytes; rank 0 sends 10 bytes to rank 3 on pp (for the p2p rule)."""
    events = []
    for r in range(4):
        e = [syn.ev("F", 0, 0.0, 1.0), syn.ev("tp.allreduce", 0, 1.0, 1.1, nbytes=100),
             syn.ev("dp.allreduce", 0, 1.1, 1.2, nbytes=1000),
             syn.ev("dp.wait", 0, 1.2, 1.3, nbytes=1000),
             syn.ev("world.allreduce", 0, 1.3, 1.4, nbytes=8)]
        if r == 0:
            e.append(syn.ev("pp.send", 0, 1.4, 1.5, nbytes=10, peer=3))
        if r == 3:
            e.append(syn.ev("pp.recv", 0, 1.4, 1.5, nbytes=10, peer=0))
        events.append(e)
    return syn.write(tmp_path / "t.h5", events, {"dp": 2, "pp": 1, "tp": 2},
                     attrs={"hostnames": json.dumps(hosts)})


def test_tp_inside_nodes_dp_across(tmp_path):
    path = dump(tmp_path, ["n0", "n0", "n1", "n1"])
    got = link_bytes(path)
    assert got["tp"] == {"within": 400, "across": 0}
    assert got["dp"] == {"within": 0, "across": 4000}  # the wait is not counted again
    assert got["world"] == {"within": 0, "across": 32}
    assert got["pp"] == {"within": 0, "across": 10}  # the send only, not its receive
    text = links_text(path)
    assert "2 hosts" in text and "across" in text
    assert any(line.split()[:4] == ["tp", "0.000", "0.000", "0%"] for line in text.splitlines())


def test_tp_across_nodes(tmp_path):
    got = link_bytes(dump(tmp_path, ["n0", "n1", "n0", "n1"]))
    assert got["tp"] == {"within": 0, "across": 400}
    assert got["dp"] == {"within": 4000, "across": 0}
    assert got["pp"] == {"within": 0, "across": 10}  # ranks 0 and 3 on n0 and n1


def test_one_host_prints_nothing(tmp_path):
    path = dump(tmp_path, ["n0"] * 4)
    assert links_text(path) == ""
    assert link_bytes(path)["dp"] == {"within": 4000, "across": 0}
