"""The lean reference loop (mpipar/mpi/bench/lean.py), the floor the benchmark measures mpipar
against, computes what mpipar computes: float64, the same weights and batches, every layout."""

import pytest
from mpi_util import python_script

LAYOUTS = [("single", 1), ("dp", 2), ("naive", 2), ("gpipe", 2), ("1f1b", 2)]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("layout,ranks", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_lean_loop_matches_mpipar(layout, ranks):
    res = python_script(ranks, "lean_equiv.py", layout, timeout=180)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert f"ok   lean {layout}:" in res.stdout, res.stdout


def test_lean_refuses_an_unknown_layout():
    from mpipar.mpi.bench.lean import Lean

    class OneRank:  # Lean reads only the rank and size before checking the layout
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

    with pytest.raises(ValueError, match="choose one of"):
        Lean(OneRank(), "zigzag", [], 4)
