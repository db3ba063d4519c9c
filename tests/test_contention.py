"""Contention between ranks of one node (mpipar.analysis.contention) on hand-made dumps whose
answer is known, and calibrate.py's mark."""

import json
import sys
from pathlib import Path

import pytest

from mpipar.analysis.contention import contention
from mpipar.analysis.dump import load
from mpipar.analysis.synthetic import ev, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


def _dump(path, slow: float, hosts=("n0", "n0"), steps=3):
    """Two ranks. Per step, rank 0 runs four forwards: the first and last alone (1 s each), the
    middle two while rank 1 runs two forwards of its own; those four take ``slow`` s each."""
    r0, r1 = [], []
    for s in range(steps):
        t = 100.0 * s
        mid = [t + 1 + slow * i for i in range(3)]
        r0 += [ev("STEP", s, t, t + 3 + 2 * slow + 1), ev("F", s, t, t + 1, mb=0, chunk=0),
               ev("F", s, mid[0], mid[1], mb=1, chunk=0), ev("F", s, mid[1], mid[2], mb=2, chunk=0),
               ev("F", s, mid[2], mid[2] + 1, mb=3, chunk=0)]
        r1 += [ev("STEP", s, t, t + 3 + 2 * slow + 1), ev("F", s, mid[0], mid[1], mb=0, chunk=1),
               ev("F", s, mid[1], mid[2], mb=1, chunk=1)]
    write(path, [r0, r1], {"dp": 1, "pp": 2, "tp": 1},
          attrs={"hostnames": json.dumps(list(hosts))})
    return load(path)


def test_units_slower_beside_a_neighbour_are_measured(tmp_path):
    run = _dump(tmp_path / "slow.h5", slow=1.3)
    c = contention(run, [1, 2])
    # rank 0 (mean 1.15): alone 1/1.15, beside rank 1 1.3/1.15; rank 1's units are all beside
    assert c["solo"] == pytest.approx(1 / 1.15)
    assert c["concurrent"] == pytest.approx((2 * 1.3 / 1.15 + 2 * 1.0) / 4)
    assert c["slowdown"] > 1.2 and c["r2"] > 0.7 and c["units"] == 12


def test_no_contention_reads_as_one(tmp_path):
    c = contention(_dump(tmp_path / "even.h5", slow=1.0), [1, 2])
    assert c["slowdown"] == pytest.approx(1.0) and c["r2"] == 0.0


def test_ranks_on_different_nodes_do_not_contend(tmp_path):
    # nothing to compare: no unit had a neighbour on its node
    assert contention(_dump(tmp_path / "two.h5", slow=1.3, hosts=("n0", "n1")), [1, 2]) is None


def test_calibrate_marks_a_contended_row_only(tmp_path):
    import calibrate

    assert calibrate.contended(_dump(tmp_path / "slow.h5", slow=1.3).path) > 1.2
    assert calibrate.contended(_dump(tmp_path / "even.h5", slow=1.0).path) is None
