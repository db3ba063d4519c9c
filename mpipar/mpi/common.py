"""What ``Comm`` and ``LocalComm`` share: message tags, reduction ops and argument checks.

No MPI here: ``LocalComm`` (a one-rank group) must work without it.
"""

from __future__ import annotations

import numpy as np

from mpipar.trace import Tracer

TAG_ACTIVATION = 0
TAG_GRADIENT = 1
MAX_CHUNKS = 16  # model chunks per rank a tag can tell apart
MAX_MB = 1000  # micro-batches per step a tag can tell apart
TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the standard allows

OPS = ("sum", "mean", "max")

OFF = Tracer(enabled=False)  # the tracer of an untraced communicator


def make_tag(kind: int, mb: int, chunk: int) -> int:
    """A point-to-point tag from (kind, micro-batch, chunk); ``-1`` (not applicable) counts as 0.

    kind 0 = activation (forward), 1 = gradient (backward). Distinct keys give distinct tags,
    all below 32767, so messages in flight at once between two stages never match the wrong
    receive.
    """
    if kind not in (TAG_ACTIVATION, TAG_GRADIENT):
        raise ValueError(f"tag kind must be 0 (activation) or 1 (gradient), got {kind!r}")
    if not -1 <= mb < MAX_MB:
        raise ValueError(f"micro-batch {mb} out of range for tags: use fewer than {MAX_MB}")
    if not -1 <= chunk < MAX_CHUNKS:
        raise ValueError(f"chunk {chunk} out of range for tags: use fewer than {MAX_CHUNKS}")
    return (max(mb, 0) * MAX_CHUNKS + max(chunk, 0)) * 2 + kind


class MessageSizeError(ValueError):
    """A received message does not have the byte count the receiver expected."""


def check_op(op) -> None:
    if op not in OPS:
        raise ValueError(f"reduction op must be one of {OPS}, got {op!r}")


def check_root(axis, size, r, what="root") -> int:
    """r as an int after checking it is a rank of a group of ``size``."""
    if not isinstance(r, (int, np.integer)) or not 0 <= r < size:
        raise ValueError(
            f"{axis}: {what} rank {r!r} is outside 0..{size - 1} of this communicator"
        )
    return int(r)


def check_contiguous(x, what) -> None:
    if not x.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} needs a C-contiguous array (use xp.ascontiguousarray)")


def check_divisible(comm_axis, size, x, axis) -> None:
    """reduce_scatter's rule: the scattered dimension splits evenly over the group."""
    n = x.shape[axis]
    if n % size:
        raise ValueError(
            f"{comm_axis}.reduce_scatter: dimension {axis} of shape {tuple(x.shape)} has "
            f"length {n}, not divisible by the {size} ranks of the {comm_axis} group; "
            f"make it a multiple of {size}"
        )


def norm_axis(axis, ndim) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def check_float(x, op) -> None:
    if not np.issubdtype(np.dtype(x.dtype), np.inexact):
        raise TypeError(f"op={op!r} needs a floating-point array, got {x.dtype}")
