"""Contract 1: every grid computes the one-rank model's function (float64).

Each case launches ``mpiexec -n dp*pp*tp`` once and runs several variants (schedule,
micro-batches, ZeRO-1, sequence parallelism, recomputation, MLP) on that grid; world rank 0 also
trains the one-rank model and compares the gathered step-0 gradients (<= 1e-10), the loss of each
of 3 steps (<= 1e-9) and the weights after them (<= 1e-9). See tests/mpi/equiv_train.py.
"""

import pytest
from mpi_util import python_script

from mpipar.datasets import prepare_synthetic


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov.h5"
    prepare_synthetic(path, "markov", 20000, 256, seed=0)
    return str(path)


def variants(dp, pp, tp):
    """Schedules and options valid on this grid (a GPT of 8 pipeline units; the global batch is
    2 * dp * micro-batches). Micro-batch counts below, equal to and above pp, and not multiples."""
    out = []
    if pp == 1:
        out += ["1f1b:1", "gpipe:3", "zb-h1:2"]
    else:
        out += ["1f1b:1", f"gpipe:{pp + 1}", f"1f1b:{2 * pp}", f"1f1b:{pp - 1 or 1}:recompute",
                f"zb-h1:{pp + 1}", f"gpipe:{pp}:recompute", "naive:1"]
        if pp * 2 <= 8:
            out += [f"interleaved:{pp}:v=2", f"interleaved:{2 * pp}:v=2:recompute"]
    if dp > 1:
        out.append("1f1b:2:zero1")
    if tp > 1:
        out.append("1f1b:2:sp")
        if dp > 1 and pp > 1:
            out.append(f"interleaved:{pp}:v=2:sp:zero1" if pp * 2 <= 8 else f"zb-h1:{pp}:sp:zero1")
    if dp * pp * tp == 2:  # selective recomputation (attention core only) on each 2-rank grid
        out.append(f"1f1b:{2 * pp}:selective")
    out.append("1f1b:2:mlp")
    return out


GRIDS = [(1, 1, 1),
         (2, 1, 1), (1, 2, 1), (1, 1, 2),
         (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2),
         (2, 2, 2), (4, 2, 1), (4, 1, 2), (2, 4, 1), (1, 4, 2), (2, 1, 4), (1, 2, 4)]


@pytest.mark.mpi
@pytest.mark.parametrize("grid", GRIDS, ids=[f"dp{a}-pp{b}-tp{c}" for a, b, c in GRIDS])
def test_grid_matches_one_rank(tokens, grid):
    dp, pp, tp = grid
    res = python_script(dp * pp * tp, "equiv_train.py", tokens, dp, pp, tp,
                        *variants(dp, pp, tp), timeout=300)
    report = "\n".join(line for line in res.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))
    assert res.returncode == 0, f"{report}\n{res.stderr[-3000:]}"
    assert report.count("ok  ") == len(variants(dp, pp, tp)), report


PIPEDREAM = [(1, 2, 1, 4), (1, 4, 1, 6), (2, 2, 2, 3), (1, 2, 2, 1)]


@pytest.mark.mpi
@pytest.mark.parametrize("grid", PIPEDREAM,
                         ids=[f"dp{a}-pp{b}-tp{c}-m{m}" for a, b, c, m in PIPEDREAM])
def test_pipedream_matches_its_one_rank_replay(tokens, grid):
    dp, pp, tp, m = grid
    res = python_script(dp * pp * tp, "pipedream_equiv.py", tokens, dp, pp, tp, m, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ok  " in res.stdout
