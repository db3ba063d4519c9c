"""Layer partitioning into pipeline stages / model chunks."""

import random

import pytest

from mpipar.parallel.pipeline.partition import PartitionError, chunk_layers, partition


def covers(stages, n):
    layers = [i for a, b in stages for i in range(a, b)]
    return layers == list(range(n)) and all(b > a for a, b in stages)


def test_uniform():
    assert partition(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition(7, 3) == [(0, 3), (3, 5), (5, 7)]
    for n in range(1, 30):
        for k in range(1, n + 1):
            st = partition(n, k)
            sizes = [b - a for a, b in st]
            assert covers(st, n) and len(st) == k and max(sizes) - min(sizes) <= 1


def brute_best(w, k):
    """Smallest max stage weight over all contiguous splits (for small n)."""
    from itertools import combinations

    n, best = len(w), float("inf")
    for cuts in combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(w[a:b]) for a, b in zip(edges, edges[1:], strict=False)))
    return best


def test_balanced_by_weights_is_optimal():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        w = [rng.uniform(0.1, 10.0) for _ in range(n)]
        for method in ("params", "cost"):
            st = partition(n, k, method, weights=w)
            assert covers(st, n) and len(st) == k
            assert max(sum(w[a:b]) for a, b in st) == pytest.approx(brute_best(w, k))
    # A heavy first layer (an embedding) gets a stage to itself.
    assert partition(5, 2, "params", weights=[10, 1, 1, 1, 1]) == [(0, 1), (1, 5)]


def test_explicit():
    assert partition(6, 3, "explicit", boundaries=[0, 1, 4]) == [(0, 1), (1, 4), (4, 6)]
    with pytest.raises(PartitionError, match="start at layer 0"):
        partition(6, 3, "explicit", boundaries=[1, 2, 4])
    with pytest.raises(PartitionError, match="increase strictly"):
        partition(6, 3, "explicit", boundaries=[0, 4, 4])
    with pytest.raises(PartitionError, match="3 boundaries for 2 stages"):
        partition(6, 2, "explicit", boundaries=[0, 2, 4])


def test_errors():
    with pytest.raises(PartitionError, match="8 stages but the model has 6 layers"):
        partition(6, 8)
    with pytest.raises(PartitionError,
                       match="pp\\*virtual_stages = 8 stages but the model has 6 layers"):
        chunk_layers(6, 4, 2)
    with pytest.raises(PartitionError, match="unknown partition method"):
        partition(6, 2, "magic")
    with pytest.raises(PartitionError, match="need weights"):
        partition(6, 2, "params")
    with pytest.raises(PartitionError, match="2 weights for 6 layers"):
        partition(6, 2, "cost", weights=[1, 2])
    assert issubclass(PartitionError, ValueError)


def test_chunk_layers_follow_model_order():
    ch = chunk_layers(12, 2, 3)
    assert sorted(ch) == list(range(6))
    assert [ch[c] for c in range(6)] == partition(12, 6)
    # chunk c lives on rank c % pp: rank 0 holds layers 0-1, 4-5, 8-9
    assert [ch[c] for c in range(0, 6, 2)] == [(0, 2), (4, 6), (8, 10)]
    assert chunk_layers(5, 2, 1, method="params", weights=[1, 1, 1, 1, 4]) == {0: (0, 4), 1: (4, 5)}
