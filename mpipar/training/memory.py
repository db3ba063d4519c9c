"""What the trainer records about memory (``mem.*`` events), so that it means what the memory
model (``mpipar.analysis.memory_model``) predicts.

- ``mem.static`` (once, at the start of the first step, when all set-up is done: model,
  optimizer, a resumed checkpoint, rank 0's GEMM peak measurement): the exact bytes of the
  state a step keeps from one step to the next: parameters, gradient buckets (and ZeRO-1's
  gradient slices), optimizer state, each buffer counted once (a view counts its base once).
- ``mem.base`` (with ``mem.static``): the resident memory of the process then, with that state
  touched first (NumPy's zeros are calloc'd: untouched pages are not resident, so the optimizer
  state would otherwise show up inside the first step, on top of ``mem.static``).
- ``mem.peak`` (after each step): the resident high-water mark since the base. Linux lets a
  process reset its high-water mark (``/proc/self/clear_refs``, ``5``); the trainer does so when
  it takes the base, so what the data set, the imports and the set-up briefly held (parameter
  masters are made in float64, rank 0 measures its GEMM peak) does not count. Where the reset
  is not possible the lifetime peak (``ru_maxrss``, with set-up's transients) is recorded
  instead; ``mem.base``'s ``peer`` field says which: 1 reset, 0 lifetime.

The measured peak of a rank is ``static + max(peak) - base``: the state counted exactly, plus what
the steps added: activations held for the backward, the transient working set of a backward, reused
buffers (``nn.cpu``'s pool keeps every shape's high-water count; the receive pool; the collectives'
host scratch), the optimizer's scratch. Also in it, and in the model only as one number per machine
(``memory_model.RUNTIME_BYTES``, its runtime term, measured by ``experiments/memory_runtime.py
--runtime``): memory outside NumPy that the steps touch first: BLAS's packing buffers (0.5-1.8 MiB
for one OpenBLAS product here, by size), MPI's and HDF5's own buffers, what the allocator keeps of
freed temporaries (together 2-6 MiB per rank here: experiments/README.md, section 2b). One of them
used to come and stay at a step nobody chose: MPICH's block of 4,096 more request objects (4,096 x
520 bytes, 2.03 MiB), allocated the first time more than about 17 requests are alive at once,
which happened to a pipeline-first tensor-parallel pair of the README's dp2 pp2 tp2
job at a random step in 2 of 3 runs under load (+1.9-2.1 MiB, a quarter of its peak). The grid now
makes that block at set-up (``mpipar.mpi.request_pool``), inside the base. Not in it: the
interpreter, imports, the data set (all in the base). On a GPU the host's resident memory says
nothing about the device's: there ``mem.peak`` is the bytes CuPy's pool holds (its high-water
mark: the pool keeps freed blocks) and the base what it held at the first step.
"""

from __future__ import annotations

import os
import sys


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; else its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return lifetime_peak_bytes()


def lifetime_peak_bytes() -> int:
    """The process's peak resident memory since it started (``ru_maxrss``)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # macOS: bytes, Linux: KiB


def reset_peak() -> bool:
    """Reset the resident high-water mark to the current resident size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """The resident high-water mark (since the last ``reset_peak``; VmHWM of /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return lifetime_peak_bytes()


def state_arrays(trainer) -> list:
    """Every array a step keeps across steps: parameters, gradients, optimizer state."""
    out = [p.data for p in trainer.params] + [p.grad for p in trainer.params]
    sync = trainer.sync
    out += [b.grad for bs in sync.buckets.values() for b in bs]
    out += [s.grad for s in sync.shards] + [s.data for s in sync.shards]
    opts = getattr(trainer.opt, "chunks", None) or {0: trainer.opt}
    for opt in opts.values():
        out += [a for st in opt.state.values() for a in st.values()]
    return out


def distinct_bytes(arrays) -> int:
    """Bytes of the distinct buffers behind ``arrays`` (a view counts its base once)."""
    seen = {}
    for a in arrays:
        root = a
        while getattr(root, "base", None) is not None and hasattr(root.base, "nbytes"):
            root = root.base
        seen[id(root)] = int(root.nbytes)
    return sum(seen.values())


def _gpu_pool(backend):
    xp = getattr(backend, "xp", None)
    if xp is not None and xp.__name__ == "cupy":
        return xp.get_default_memory_pool()
    return None


def record_setup(tracer, trainer, backend) -> None:
    """``mem.static`` and ``mem.base`` after set-up, the high-water mark reset."""
    if not tracer.enabled:
        return
    arrays = state_arrays(trainer)
    pool = _gpu_pool(backend)
    if pool is None:
        for a in arrays:
            touch(a)
        warm_blas(backend)
        _release_freed()
    now = tracer.now()
    tracer.record("mem.static", now, now, nbytes=distinct_bytes(arrays))
    reset = pool is not None or reset_peak()
    base = pool.total_bytes() if pool is not None else resident_bytes()
    tracer.record("mem.base", now, now, nbytes=base, peer=int(reset))


def touch(a) -> None:
    """Make every page of ``a`` resident without changing it (a resumed optimizer state is
    already loaded here): one element per page written back as it is."""
    flat = a.reshape(-1)  # the state arrays are contiguous: a view
    step = max(1, 4096 // a.itemsize)
    flat[::step] = flat[::step].copy()


WARM_N = 512  # the product ``perf.device_peak`` times on the CPU


def warm_blas(backend) -> None:
    """One product of the size ``perf.device_peak`` times, on every rank, before the base.

    BLAS keeps the buffers it packs its operands into once it has touched them. World rank 0
    touches them in set-up (it measures the GEMM peak for MFU), every other rank at its first
    product inside a step: so the others' step peaks held 0.3-0.4 MiB that rank 0's did not
    (17 % of a 2-rank grid's 2.5 MiB peak, 2-4 points on the 8-rank grids). One product of
    the same size makes every rank's base hold them alike."""
    import numpy as np

    a = np.ones((WARM_N, WARM_N), dtype=backend.dtype)
    np.matmul(a, a)


def _release_freed() -> None:
    """Give what set-up freed back to the system before the base is taken: ``nn.cpu``'s idle
    buffers (rank 0's GEMM peak measurement leaves some) and the free pages glibc keeps
    (``malloc_trim``). Otherwise the steps reuse memory already counted in the base, and the
    peak above it comes out short by as much (2-3 MiB of 20 on rank 0 here)."""
    import ctypes

    from ..nn import cpu

    cpu.clear_pool()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim through this door
        pass


def step_peak(backend) -> int:
    """What ``mem.peak`` records after a step (see the module doc)."""
    pool = _gpu_pool(backend)
    return pool.total_bytes() if pool is not None else peak_resident_bytes()
