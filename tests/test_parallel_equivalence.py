"""Same function, any grid (docs/architecture.md): every grid computes the one-rank model's
function (float64).

Each case launches ``mpiexec -n dp*pp*tp`` once and runs several variants (schedule,
micro-batches, ZeRO-1, sequence parallelism, recomputation, MLP, 2D tensor parallelism
at tp = 4) on that grid; world rank 0 also
trains the one-rank model and compares the gathered step-0 gradients (<= 1e-10), the loss of each
of 3 steps (<= 1e-9) and the weights after them (<= 1e-9). See tests/mpi/equiv_train.py.
"""

from pathlib import Path

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
    out += new_schedule_variants(dp, pp, tp) + torch_csv_variants(dp, pp, tp)
    if dp > 1:
        out.append("1f1b:2:zero1")
    if tp > 1:
        out.append("1f1b:2:sp")
        if dp > 1 and pp > 1:
            out.append(f"interleaved:{pp}:v=2:sp:zero1" if pp * 2 <= 8 else f"zb-h1:{pp}:sp:zero1")
    if tp == 4:  # 2D tensor parallelism (q = 2), alone and with pp and dp (issue 17)
        out.append("1f1b:2:2d")
        if pp > 1:
            out.append(f"zb-h1:{pp + 1}:2d")
    if dp * pp * tp == 2:  # selective recomputation (attention core only) on each 2-rank grid
        out.append(f"1f1b:{2 * pp}:selective")
    out.append("1f1b:2:mlp")
    return out


def new_schedule_variants(dp, pp, tp):
    """The 2023-2025 schedules (issue 16): all of them with micro-batches below, equal to and
    above pp (where the schedule allows), with and without recompute, on the pure pipelines pp=2
    and pp=4; and one case each inside the dp and tp grids of up to 8 ranks (kept few: each
    variant costs a run on its grid)."""
    if pp == 1:
        return []
    if (dp, tp) == (1, 1):
        lo = max(pp - 1, 1)
        # uneven stages from a layout string, the last one heavy (6 blocks: E t*6 L)
        heavy = ([f"1f1b:{pp + 1}:layout=Et|t*5L", "zb-v:4:v=2:layout=E,t|t|t|t*3L"] if pp == 2
                 else [f"zb-h1:{pp + 1}:layout=Et|(t|)*2,t*3L"])
        return [f"zb-h2:{lo}", f"zb-h2:{2 * pp}:recompute", f"zb-v:{pp}:v=2",
                f"zb-v:{2 * pp}:v=2:recompute", f"zb-v:{lo}:v=2", f"looped-bfs:{pp + 1}:v=2",
                f"looped-bfs:{lo}:v=2:recompute", f"v-half:{pp}:v=2:recompute",
                f"v-half:{2 * pp + 1}:v=2", f"v-min:{pp + 1}:v=2", f"dualpipev:{2 * pp}:v=2",
                f"dualpipev:{2 * pp + 1}:v=2:recompute", f"pipedream-2bw:{pp + 1}"] + heavy
    return {(2, 4, 1): [f"zb-v:{2 * pp}:v=2", f"dualpipev:{2 * pp}:v=2:recompute"],
            (1, 4, 2): [f"zb-h2:{pp + 1}:sp", f"v-half:{pp}:v=2"],
            (2, 2, 2): [f"looped-bfs:{pp}:v=2:zero1", f"v-min:{pp}:v=2:recompute",
                        f"pipedream-2bw:{pp}:sp"],
            (1, 2, 4): [f"dualpipev:{2 * pp}:v=2"]}.get((dp, pp, tp), [])


TORCH = Path(__file__).resolve().parent.parent / "experiments" / "data" / "torch"


def torch_csv_variants(dp, pp, tp):
    """torch.distributed.pipelining's own schedules (experiments/torch_schedules.py wrote the
    CSVs), compute-only and with torch's sends and receives, run by mpipar's executor."""
    if (dp, tp) != (1, 1) or pp not in (2, 4):
        return []
    names = sorted(TORCH.glob(f"*_pp{pp}_m*.csv"))
    if pp == 4:  # the V-shaped ones; pp = 2 runs them all
        names = [n for n in names if n.name.startswith(("zb-v", "dualpipev"))]
    out = []
    for path in names:
        m = int(path.stem.split("_m")[1].split("_")[0])
        out.append(f"torch-{path.stem}:{m}:v=2:csv={path}")
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


ND_MODES = ["1f1b:2:2.5d", "zb-h1:3:2.5d", "1f1b:2:3d", "gpipe:3:3d:recompute"]


@pytest.mark.mpi
def test_2p5d_and_3d_match_one_rank_at_8_ranks(tokens):
    """2.5D (q = 2, d = 2) and 3D (q = 2) on dp1 pp1 tp8 (issue 17)."""
    res = python_script(8, "equiv_train.py", tokens, 1, 1, 8, *ND_MODES, timeout=300)
    report = "\n".join(line for line in res.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))
    assert res.returncode == 0, f"{report}\n{res.stderr[-3000:]}"
    assert report.count("ok  ") == len(ND_MODES), report


PIPEDREAM = [(1, 2, 1, 4), (1, 4, 1, 6), (2, 2, 2, 3), (1, 2, 2, 1)]


@pytest.mark.mpi
@pytest.mark.parametrize("grid", PIPEDREAM,
                         ids=[f"dp{a}-pp{b}-tp{c}-m{m}" for a, b, c, m in PIPEDREAM])
def test_pipedream_matches_its_one_rank_replay(tokens, grid):
    dp, pp, tp, m = grid
    res = python_script(dp * pp * tp, "pipedream_equiv.py", tokens, dp, pp, tp, m, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ok  " in res.stdout
