"""Parameters: full-shape masters from (seed, name), sharded by a spec, with their gradients.

"Full-shape masters" (docs/architecture.md): every parameter is first made as the full tensor, from
the seed and the parameter's name alone, and each rank keeps its shard. So every grid starts from
the same weights, and init, checkpoints, clipping and the equivalence tests all use the one
``ShardSpec``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardSpec:
    """``axis=None``: replicated over tensor parallelism. Otherwise split evenly along ``axis``.

    ``partial_grad``: the gradient of a replicated parameter is a partial sum on each tp rank
    (sequence parallelism: LayerNorm sees only a shard of the sequence) and must be all-reduced
    over tp before use.
    """

    axis: int | None = None
    partial_grad: bool = False
    # multi-dimensional tensor parallelism (2D / 2.5D / 3D): ``grid`` is the shape of the tp
    # group (tp rank = row-major index over it) and ``split`` lists (tensor axis, grid dim) pairs:
    # the tensor axis is cut into grid[dim] blocks and the rank keeps block coords[dim]. Pairs
    # naming the same tensor axis nest (the first cut, then the second inside its block). The
    # tensor is replicated over the grid dims no pair names. ``axis`` stays None for these.
    split: tuple = ()
    grid: tuple = ()

    @property
    def replicated(self) -> bool:
        return self.axis is None and not self.split

    def coords(self, rank: int) -> tuple:
        """This tp rank's coordinates on ``grid`` (row-major)."""
        return tuple(int(c) for c in np.unravel_index(rank, self.grid))

    def owns(self, rank: int) -> bool:
        """Whether this rank's copy counts once (gradient norm): coordinate 0 on every grid dim
        the tensor is replicated over."""
        used = {d for _, d in self.split}
        return all(c == 0 for k, c in enumerate(self.coords(rank)) if k not in used)

    def block_index(self, full_shape, rank: int) -> tuple:
        """The slices of the full tensor this rank keeps."""
        index = [slice(0, n) for n in full_shape]
        c = self.coords(rank)
        for ax, d in self.split:
            lo, hi = index[ax].start, index[ax].stop
            lo2, hi2 = shard_bounds(hi - lo, c[d], self.grid[d], f"axis {ax}")
            index[ax] = slice(lo + lo2, lo + hi2)
        return tuple(index)


REPLICATED = ShardSpec()

# What a parameter is for, declared where it is made. Weight decay follows the role, not the
# number of dimensions (the fused qkv bias is stored as (3, d) and is still a bias): matrices of
# linears and embedding tables decay; biases and LayerNorm gains/biases never do (Megatron,
# nanoGPT).
ROLES = ("weight", "embedding", "bias", "norm")
DECAYING_ROLES = ("weight", "embedding")


def name_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on the seed and the parameter's name (not on the rank)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])


def make_master(seed: int, name: str, shape: tuple[int, ...], init: str, std: float) -> np.ndarray:
    """The full-shape float64 master tensor of a parameter."""
    if init == "normal":
        return name_rng(seed, name).normal(0.0, std, size=shape)
    if init == "zeros":
        return np.zeros(shape)
    if init == "ones":
        return np.ones(shape)
    raise ValueError(f"unknown init {init!r} for parameter {name}")


def shard_bounds(n: int, rank: int, size: int, what: str = "dimension") -> tuple[int, int]:
    if n % size:
        raise ValueError(f"{what} of size {n} does not divide by tensor-parallel size {size}")
    k = n // size
    return rank * k, (rank + 1) * k


def take_shard(full, spec: ShardSpec, rank: int, size: int, what: str = "parameter"):
    if spec.split:
        return full[spec.block_index(full.shape, rank)]
    if spec.axis is None or size == 1:
        return full
    lo, hi = shard_bounds(full.shape[spec.axis], rank, size, what)
    index = [slice(None)] * full.ndim
    index[spec.axis] = slice(lo, hi)
    return full[tuple(index)]


def assemble(shards, spec: ShardSpec, full_shape):
    """The full tensor from every tp rank's shard (``shards[r]``: rank r's), by ``spec.split``.
    Replicated grid dims give equal copies; the last one written wins."""
    out = np.empty(full_shape, dtype=np.asarray(shards[0]).dtype)
    for r, s in enumerate(shards):
        out[spec.block_index(full_shape, r)] = s
    return out


class Parameter:
    """One rank's shard of a named parameter, its gradient buffer and its sharding spec."""

    def __init__(self, name, full_shape, backend, *, role, spec=REPLICATED, tp_rank=0, tp_size=1,
                 init="normal", std=0.02, seed=0):
        if role not in ROLES:
            raise ValueError(f"parameter {name}: role {role!r} is not one of {ROLES}")
        self.name = name
        self.role = role
        self.full_shape = tuple(int(s) for s in full_shape)
        self.spec = spec
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.backend = backend
        self.init, self.std = init, std
        master = make_master(seed, name, self.full_shape, init, std)
        self.data = None
        self.grad = None
        self.load_full(master)

    @property
    def decay(self) -> bool:
        """Whether weight decay applies (from the role: see ``DECAYING_ROLES``)."""
        return self.role in DECAYING_ROLES

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self) -> int:
        return int(self.data.size)

    def load_full(self, full) -> None:
        """Set this rank's shard from a full-shape (host or device) tensor."""
        full_np = np.asarray(full) if isinstance(full, np.ndarray) else full
        if tuple(full_np.shape) != self.full_shape:
            raise ValueError(f"parameter {self.name}: expected shape {self.full_shape}, "
                             f"got {tuple(full_np.shape)}")
        shard = take_shard(full_np, self.spec, self.tp_rank, self.tp_size, self.name)
        xp, dtype = self.backend.xp, self.backend.dtype
        self.data = xp.array(shard, dtype=dtype)  # owned copy, contiguous
        self.grad = xp.zeros_like(self.data)

    def zero_grad(self) -> None:
        self.grad.fill(0)

    def __repr__(self):
        return (f"Parameter({self.name}, shard {tuple(self.shape)} of {self.full_shape}, "
                f"axis={self.spec.axis})")
