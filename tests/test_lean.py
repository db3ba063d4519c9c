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


def test_lean_batches_fixed_or_drawn_per_step_from_a_set():
    import numpy as np

    from mpipar.mpi.bench.lean import batches, parse_args, synthetic_batch

    sizes = [6, 4, 3]
    fixed = batches(np.random.default_rng(1), parse_args(["--batch", "8"]), sizes, np.float32)
    assert fixed(0)[0] is fixed(4)[0] and fixed(0)[0] is not fixed(1)[0]  # 4, cycled
    args = parse_args(["--batch", "8", "--data-rows", "50"])
    draw = batches(np.random.default_rng(1), args, sizes, np.float32)
    x0, y0 = draw(0)
    assert x0.shape == (8, 6) and x0.dtype == np.float32 and y0.shape == (8,)
    again = batches(np.random.default_rng(1), args, sizes, np.float32)(0)
    assert np.array_equal(x0, again[0]) and np.array_equal(y0, again[1])  # the step decides
    assert not np.array_equal(x0, draw(1)[0])
    x_all, _ = synthetic_batch(np.random.default_rng(1), 50, sizes, np.float32)
    assert all((x_all == row).all(axis=1).any() for row in x0)  # rows of the set
    epoch = np.concatenate([draw(s)[0] for s in range(6)])  # 48 of the 50 rows: none twice
    assert len(np.unique(epoch, axis=0)) == 48
    assert draw(6)[0].shape == (8, 6)  # the batch that runs into the next epoch
