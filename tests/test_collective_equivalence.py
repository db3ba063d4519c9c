"""Same function, any grid (docs/architecture.md) with every collective algorithm forced in turn
(``MPIPAR_COLLECTIVES``).

A representative subset of tests/test_parallel_equivalence.py: data parallel with overlapped
buckets (non-blocking all-reduce) and ZeRO-1 (reduce-scatter, all-gather), tensor parallel with
sequence parallelism, a pipeline, and a group of 3 (Rabenseifner's fold, uneven ring blocks).
Every variant must match the one-rank model as the library's collectives do (float64, 1e-10).
"""

import pytest
from mpi_util import python_script

from mpipar.datasets import prepare_synthetic
from mpipar.mpi.algorithms import ALGORITHMS

CASES = [
    ((2, 1, 2), ["1f1b:2:zero1", "1f1b:2:sp", "1f1b:2:mlp"]),
    ((3, 1, 1), ["1f1b:2", "1f1b:2:zero1"]),
    ((2, 2, 1), ["1f1b:4", "1f1b:2:zero1"]),
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov.h5"
    prepare_synthetic(path, "markov", 20000, 256, seed=0)
    return str(path)


@pytest.mark.mpi
@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("grid,variants", CASES,
                         ids=[f"dp{a}-pp{b}-tp{c}" for (a, b, c), _ in CASES])
def test_forced_algorithm_matches_one_rank(tokens, algo, grid, variants):
    dp, pp, tp = grid
    res = python_script(dp * pp * tp, "equiv_train.py", tokens, dp, pp, tp, *variants,
                        timeout=300, env={"MPIPAR_COLLECTIVES": algo})
    report = "\n".join(line for line in res.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))
    assert res.returncode == 0, f"{algo}: {report}\n{res.stderr[-3000:]}"
    assert report.count("ok  ") == len(variants), report
