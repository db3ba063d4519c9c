"""The communicator the layers above ``mpi/`` program against: ``Communicator``.

``ProcessGrid`` hands out one per grid axis: a ``Comm`` (``comm.py``, two or more ranks, MPI
underneath) or a ``LocalComm`` (``local.py``, one rank, no MPI at all). Both implement every
operation below with these signatures, so code above never asks which it holds; where work must
be skipped on an axis that is not split it tests ``comm.size > 1``. A non-blocking operation
returns a ``Pending`` (``requests.Request``). ``tests/test_comm.py`` checks both classes
against this module, names and signatures alike.

Arrays are NumPy or CuPy; ``x`` must be C-contiguous where an operation works in place or hands
it to MPI as it is (the operations say so when it is not). Only ``Comm`` offers more (the
algorithm choice of its collectives, ``coll_mode``, ``shm_offered``: ``commbench`` and the
tests use them); nothing above ``mpi/`` needs them.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Pending(Protocol):
    """A posted non-blocking operation."""

    @property
    def done(self) -> bool:
        """Known to be complete (``test`` or ``wait`` saw it finish)."""

    def wait(self) -> Any:
        """Block until complete; the received or reduced array (None for a send)."""

    def test(self) -> bool:
        """Whether it is complete, advancing it without blocking."""


@runtime_checkable
class Communicator(Protocol):
    """One group of ranks (a grid axis), traced; the 17 operations every layer may call."""

    axis: str  # the trace events' prefix: "<axis>.<op>"
    size: int
    rank: int
    world_ranks: list[int]  # local rank -> world rank
    tracer: Any  # mpipar.trace.Tracer (disabled when not tracing)
    backend: Any  # the array backend of received arrays (None: NumPy)

    # --- point to point (a one-rank group has no peer: these raise) ---------------------------

    def send(self, x, dest, tag, *, mb=-1, chunk=-1) -> None:
        """Blocking send of x to local rank ``dest``; ``tag`` from ``make_tag``."""

    def recv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None, out=None) -> Any:
        """Receive exactly ``shape``/``dtype`` into a new array, or into ``out``."""

    def isend(self, x, dest, tag, *, mb=-1, chunk=-1) -> Pending:
        """Post a send; x stays alive and unchanged until ``wait``."""

    def irecv(self, shape, dtype, source, tag, *, mb=-1, chunk=-1, xp=None,
              out=None) -> Pending:
        """Post a receive; ``wait()`` returns the array."""

    # --- collectives ------------------------------------------------------------------------

    def allreduce(self, x, op="sum", inplace=False) -> Any:
        """Elementwise ``op`` ("sum", "mean", "max") over the group; a new array, or x."""

    def iallreduce(self, x, op="sum") -> Pending:
        """Post an in-place all-reduce of x; ``wait()`` returns x."""

    def reduce_scatter(self, x, axis=0, op="sum", out=None) -> Any:
        """This rank's 1/size slice, along ``axis``, of the reduction."""

    def ireduce_scatter(self, x, out, op="sum") -> Pending:
        """Post a reduce-scatter along axis 0 into ``out``; ``wait()`` returns out."""

    def allgather(self, x, axis=0, out=None) -> Any:
        """Every rank's x concatenated along ``axis`` in rank order."""

    def broadcast(self, x, root=0) -> Any:
        """Overwrite x with root's x, in place; returns x."""

    def allreduce_scalar(self, value, op="sum") -> float:
        """A float reduced over the group."""

    def gather_bytes(self, data, root=0, *, trace=True) -> list[bytes] | None:
        """Every rank's bytes as a list on ``root``, None elsewhere."""

    def broadcast_bytes(self, data, root=0, *, trace=True) -> bytes:
        """Root's bytes on every rank."""

    def barrier(self) -> None:
        """Wait for every rank of the group."""

    # --- buffers and bookkeeping ------------------------------------------------------------

    def registered_zeros(self, sizes, dtype, xp=None) -> list:
        """Zeroed 1-D arrays the collectives may reduce without copying (collective)."""

    def world_rank_of(self, local_rank) -> int:
        """The world rank of a rank of this group."""

    def free(self) -> None:
        """Release what the communicator holds (collective)."""


OPERATIONS = tuple(name for name, value in vars(Communicator).items()
                   if callable(value) and not name.startswith("_"))
ATTRIBUTES = tuple(Communicator.__annotations__)


def mismatches(cls) -> list[str]:
    """How ``cls`` departs from ``Communicator``: each operation missing, or declared with other
    parameters (names, kinds, defaults; annotations aside). Empty when it conforms."""
    out = []
    for name in OPERATIONS:
        mine = getattr(cls, name, None)
        if not callable(mine):
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        want, got = _bare(getattr(Communicator, name)), _bare(mine)
        if want != got:
            out.append(f"{cls.__name__}.{name}{got}: the interface says {name}{want}")
    return out


def _bare(fn) -> inspect.Signature:
    """fn's parameters (names, kinds, defaults), without annotations."""
    params = inspect.signature(fn).parameters.values()
    return inspect.Signature([p.replace(annotation=p.empty) for p in params])
