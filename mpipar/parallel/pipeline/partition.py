"""Split a model's layers into contiguous pipeline stages (or model chunks).

Stages are half-open layer ranges ``(start, end)``, in order, covering every layer exactly once,
none empty. Methods:

- ``uniform``: by layer count; the first ``n_layers % n_stages`` stages get one layer more.
- ``params`` / ``cost``: by ``weights``, one number per layer: the contiguous split that
  minimises the largest stage weight. Both methods run the same code on whatever weights the
  caller gives; the trainer passes each unit's full (unsharded) parameter count plus one for both,
  never measured times, so ``cost`` is the same split as ``params`` there.
- ``explicit``: ``boundaries`` = the first layer of each stage, e.g. ``[0, 3, 5]``.
"""

from __future__ import annotations

METHODS = ("uniform", "params", "cost", "explicit")


class PartitionError(ValueError):
    """A partition that cannot be made; the message says what to change."""


def partition(
    n_layers: int, n_stages: int, method: str = "uniform", weights=None, boundaries=None
) -> list[tuple[int, int]]:
    if not isinstance(n_layers, int) or n_layers < 1:
        raise PartitionError(f"the model needs at least one layer, got n_layers={n_layers!r}")
    if not isinstance(n_stages, int) or n_stages < 1:
        raise PartitionError(f"n_stages must be a positive integer, got {n_stages!r}")
    if n_stages > n_layers:
        raise PartitionError(
            f"{n_stages} stages but the model has {n_layers} layers; every stage needs at least "
            f"one layer: use at most {n_layers} stages or a deeper model"
        )
    if method == "uniform":
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
        starts = [sum(sizes[:s]) for s in range(n_stages)]
    elif method in ("params", "cost"):
        starts = _balanced_starts(_check_weights(weights, n_layers), n_stages)
    elif method == "explicit":
        starts = _check_boundaries(boundaries, n_layers, n_stages)
    else:
        raise PartitionError(f"unknown partition method {method!r}; valid: {', '.join(METHODS)}")
    stages = [(starts[s], starts[s + 1] if s + 1 < n_stages else n_layers) for s in range(n_stages)]
    _assert_cover(stages, n_layers)
    return stages


def chunk_layers(
    n_layers: int, pp: int, virtual_stages: int = 1, **kw
) -> dict[int, tuple[int, int]]:
    """Global chunk c (on rank c % pp) -> its layer range; chunks are stages in model order."""
    n = pp * virtual_stages
    if n > n_layers:
        raise PartitionError(
            f"pp*virtual_stages = {n} stages but the model has {n_layers} layers; lower pp or "
            f"virtual_stages (pp*virtual_stages <= {n_layers}) or use a deeper model"
        )
    return dict(enumerate(partition(n_layers, n, **kw)))


def _check_weights(weights, n_layers: int) -> list[float]:
    if weights is None:
        raise PartitionError("methods 'params' and 'cost' need weights (one number per layer)")
    w = [float(x) for x in weights]
    if len(w) != n_layers:
        raise PartitionError(f"got {len(w)} weights for {n_layers} layers; give one per layer")
    if any(x < 0 or x != x for x in w):
        raise PartitionError("layer weights must be numbers >= 0")
    return w


def _balanced_starts(w: list[float], k: int) -> list[int]:
    """Linear partition by dynamic programming: minimise the largest contiguous stage sum.

    best[s][i] = smallest possible max-stage-weight splitting layers [0, i) into s stages.
    O(k n^2), trivial for model depths. Ties go to the earliest cut (deterministic).
    """
    n = len(w)
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):  # last stage is [j, i), non-empty
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    starts, i = [], n
    for s in range(k, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def _check_boundaries(boundaries, n_layers: int, n_stages: int) -> list[int]:
    if boundaries is None:
        raise PartitionError("method 'explicit' needs boundaries: the first layer of each stage")
    b = [int(x) for x in boundaries]
    if len(b) != n_stages:
        raise PartitionError(f"got {len(b)} boundaries for {n_stages} stages; give one per stage")
    if b[0] != 0:
        raise PartitionError(f"the first stage must start at layer 0, got boundaries {b}")
    for s in range(1, n_stages):
        if not b[s - 1] < b[s] < n_layers:
            raise PartitionError(
                f"boundaries {b} must increase strictly and stay below n_layers={n_layers} "
                f"(stage {s} would be empty or out of range)"
            )
    return b


def _assert_cover(stages: list[tuple[int, int]], n_layers: int) -> None:
    """Every layer in exactly one non-empty stage, in order (guards the methods above)."""
    pos = 0
    for s, (a, b) in enumerate(stages):
        if a != pos or b <= a:
            raise PartitionError(f"internal error: stage {s} = [{a}, {b}) after layer {pos}")
        pos = b
    if pos != n_layers:
        raise PartitionError(f"internal error: stages cover {pos} of {n_layers} layers")
