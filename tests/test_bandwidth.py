"""analysis/bandwidth.py: achieved bandwidth per collective kind from a dump's events."""

import pytest

from mpipar.analysis import synthetic as sy
from mpipar.analysis.bandwidth import bandwidth, bandwidth_text

ev = sy.ev


def test_bandwidth_per_collective_kind(tmp_path):
    # dp=2, tp=2: blocking tp collectives, a non-blocking dp all-reduce (post, then wait), p2p
    def rank(r):
        return [
            ev("STEP", 0, 0.0, 10.0),
            ev("tp.allreduce", 0, 1.0, 1.5, mb=0, chunk=0, nbytes=1_000_000),
            ev("tp.allreduce", 0, 2.0, 2.5, mb=1, chunk=0, nbytes=1_000_000),
            ev("tp.allgather", 0, 3.0, 3.25, nbytes=500_000),  # 1 MB gathered over 2 ranks
            ev("dp.allreduce", 0, 4.0, 4.001, nbytes=4_000_000),  # the post
            ev("pp.wait", 0, 4.5, 4.6, nbytes=64, peer=1),  # a p2p wait: not paired
            ev("dp.wait", 0, 5.5, 6.0, nbytes=4_000_000),  # its completion
            ev("dp.reduce_scatter", -1, 7.0, 8.0, nbytes=2_000_000),  # outside the steps
        ]

    path = sy.write(tmp_path / "bw.h5", [rank(r) for r in range(4)], {"dp": 2, "pp": 1, "tp": 2})
    rows = {r["kind"]: r for r in bandwidth(path)}
    assert set(rows) == {"tp.allreduce", "tp.allgather", "dp.allreduce"}
    ar = rows["tp.allreduce"]
    assert ar["count"] == 8 and ar["seconds"] == pytest.approx(4.0)
    assert ar["algbw"] == pytest.approx(2e-3) and ar["busbw"] == pytest.approx(2e-3)  # 2(n-1)/n=1
    ag = rows["tp.allgather"]
    assert ag["algbw"] == pytest.approx(4e-3) and ag["busbw"] == pytest.approx(2e-3)
    dp = rows["dp.allreduce"]
    assert dp["overlapped"] and dp["seconds"] == pytest.approx(4 * 2.0)  # post to completion
    assert not ar["overlapped"]
    text = bandwidth_text(path)
    assert "dp.allreduce" in text and ">=" in text and "tp.allgather" in text
    assert "dp.reduce_scatter" not in text
