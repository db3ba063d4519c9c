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


def test_lean_take_gathers_what_the_rank_reads():
    """A replica takes its own block of the batch's rows; a pipeline stage the inputs only on
    the first stage and the classes only on the last (placeholders of their shape elsewhere),
    as mpipar's ranks gather; the micro-batches keep their sizes."""
    import numpy as np

    from mpipar.mpi.bench.lean import Lean, init_params

    class Comm:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

        def Get_rank(self):
            return self.rank

        def Get_size(self):
            return self.size

    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((20, 6)).astype(np.float32), rng.integers(0, 3, 20)
    rows = rng.permutation(20)[:8]
    params = init_params([6, 5, 4, 3])
    x, y = Lean(Comm(1, 2), "dp", params, 2).take(X, Y, rows)
    assert np.array_equal(x, X[rows[4:]]) and np.array_equal(y, Y[rows[4:]])
    x, y = Lean(Comm(0, 1), "single", params, 2).take(X, Y, rows)
    assert np.array_equal(x, X[rows]) and np.array_equal(y, Y[rows])
    first = Lean(Comm(0, 2), "gpipe", params, 2).take(X, Y, rows)
    last = Lean(Comm(1, 2), "gpipe", params, 2).take(X, Y, rows)
    assert np.array_equal(first[0], X[rows]) and np.array_equal(last[1], Y[rows])
    assert first[1].shape == (8,) and not first[1].flags.writeable  # the unread placeholders
    assert last[0].shape == (8, 6) and not last[0].flags.writeable
