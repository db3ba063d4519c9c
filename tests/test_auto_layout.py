"""``parallel.layout = "auto"``: stages balanced by the description's cost (``models.balance``),
head, loss and embedding counted; valid for any chunk count; training with it equals one rank."""

import itertools
from types import SimpleNamespace

import pytest
from mpi_util import python_script

from mpipar.config import load_config
from mpipar.models import stage_bounds
from mpipar.models.balance import auto_bounds, describe, unit_costs
from mpipar.parallel.pipeline.stage_layout import layout_bounds
from mpipar.training.preflight import preflight


def _gpt(n_layer, vocab=256, n_embd=32):
    return SimpleNamespace(kind="gpt", n_layer=n_layer, n_embd=n_embd, n_head=4,
                           vocab_size=vocab, block_size=32, tie_embeddings=False)


def _best_max(costs, k):
    """The smallest largest-stage cost over every contiguous cut into k non-empty stages."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("n_layer,pp,v", [(4, 2, 1), (6, 2, 2), (8, 4, 1), (6, 3, 1),
                                          (12, 2, 3), (5, 3, 2), (3, 2, 1)])
@pytest.mark.parametrize("vocab", [64, 4096])
def test_auto_is_a_valid_layout_balanced_by_the_description(n_layer, pp, v, vocab):
    m = _gpt(n_layer, vocab)
    bounds = auto_bounds(m, pp, v)
    n = n_layer + 2
    assert sorted(bounds) == list(range(pp * v))
    assert bounds[0][0] == 0 and bounds[pp * v - 1][1] == n
    assert all(bounds[c][1] == bounds[c + 1][0] for c in range(pp * v - 1))
    assert all(hi > lo for lo, hi in bounds.values())
    # the printed layout is a valid layout string that cuts the same way
    assert layout_bounds(describe(m, bounds), n_layer, pp * v) == bounds
    costs = unit_costs(m)
    worst = max(sum(costs[lo:hi]) for lo, hi in bounds.values())
    assert worst == pytest.approx(_best_max(costs, pp * v), rel=1e-12)
    # the config route: stage_bounds with layout "auto" is the same cut
    pcfg = SimpleNamespace(layout="auto", partition="uniform", boundaries=())
    assert stage_bounds(m, pcfg, pp, v) == bounds


def test_a_heavy_head_and_loss_take_blocks_off_the_last_stage():
    m = _gpt(8, vocab=8192)  # the head and the loss outweigh several blocks
    costs = unit_costs(m)
    assert costs[-1] > costs[1] and costs[0] > 0  # the embedding costs something too
    first, last = auto_bounds(m, 2, 1).values()
    assert (last[1] - last[0]) < (first[1] - first[0])
    assert describe(m, auto_bounds(m, 2, 1)).endswith("L")


def test_auto_for_an_mlp_is_described_as_boundaries():
    m = SimpleNamespace(kind="mlp", sizes=[8, 64, 64, 64, 4])
    bounds = auto_bounds(m, 2)
    assert describe(m, bounds) == "boundaries " + ",".join(str(lo) for lo, _ in bounds.values())


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_config_accepts_auto_for_any_model(kind, tmp_path):
    cfg = load_config(None, {"model.kind": kind, "parallel.pp": 2, "parallel.layout": "auto",
                             "data.path": str(tmp_path / "none.h5")})
    preflight(cfg, 2)  # no layout-string error: auto is cut from the description


@pytest.mark.mpi
def test_training_with_auto_layout_matches_one_rank(tokens):
    variants = ["1f1b:3:layout=auto", "gpipe:2:layout=auto", "interleaved:4:v=2:layout=auto",
                "zb-v:4:v=2:layout=auto", "1f1b:2:mlp:layout=auto"]
    res = python_script(2, "equiv_train.py", tokens, 1, 2, 1, *variants, timeout=300)
    report = "\n".join(line for line in res.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))
    assert res.returncode == 0, f"{report}\n{res.stderr[-3000:]}"
    assert report.count("ok  ") == len(variants), report
