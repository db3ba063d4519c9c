"""How every kernel is run, on the CPU and the GPU alike: blocks, threads, reused buffers.

All kernels (``functional``, ``layers``, the optimisers) go through these helpers whatever the
device. On the CPU (NumPy) they cut the work into cache-sized blocks, run them on mpipar's own
threads and reuse output buffers; on a GPU (CuPy) every helper is a pass-through, "one block of
everything, on the calling thread, into a fresh array": one kernel per operation is what a GPU
wants, and CuPy has its own memory pool. Nothing here changes a result: it decides only which
thread computes which rows, and into which memory.

Threads. NumPy runs each operation on one core, and OpenBLAS threads only the large products.
So mpipar owns the threads of a rank (``kernel_threads``, by default its share of the cores) and
holds BLAS at one thread: element-wise chains, attention and the optimiser run their blocks on
the threads side by side, and the large products are split into one single-threaded product per
thread (rows of the output; ``matmul``), within a few percent of OpenBLAS's own threading at the
model's products (`experiments/cpu_threads.py`: 166-196 against 164-206 GF/s on two cores at
the small config's shapes, 171-199 against 179-201 at the large one's; the head's 256 x 256
products of the small config were the exception, 110-150 against 170-200, erratic from run to
run). Shares are cut at multiples of ``ROW_ALIGN`` rows, so each output element is computed by
the same kernel code whatever the split, and every element-wise block does the same arithmetic
per row: results do not depend on the number of threads (tests/test_cpu_threads.py checks the
bits). Two pools on the same cores fought: OpenBLAS's idle workers spin for a while after every
product, on the cores the kernel threads need (OPENBLAS_THREAD_TIMEOUT shortens that, but only
if set before NumPy loads), and a product started from each kernel thread started BLAS threads
of its own.

NumPy releases the GIL inside each operation, but a hand-off to another thread costs 15-50 us
here (a futex wake, then the GIL), so work goes to the threads in blocks of ``BLOCK_ELEMENTS``
and only for arrays of at least ``PARALLEL_MIN_ELEMENTS``; smaller ones were faster on the
calling thread alone. BENCHMARKS.md has the measurements.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from ..threads import kernel_threads_setting

BLOCK_ELEMENTS = 1 << 18  # 1 MiB of float32 per array and block
PARALLEL_MIN_ELEMENTS = 1 << 20  # below this an element-wise chain runs on the calling thread
# products below this many multiply-adds are not split: the tiny config's (256 x 64 x 256, 4.2M)
# took 1.2-1.6x as long split over two threads as on one (experiments/product_split.py; measured
# on a loaded machine: re-measure quietly), the crossover near 16M; one rank of the tiny run was
# slower with two kernel threads than with one (README) while all its products were split
PARALLEL_MIN_MNK = 1 << 23
POOL_PER_SHAPE = 64  # at most this many idle-or-busy buffers kept per (shape, dtype)
# below this many bytes ``empty`` skips the pool: malloc serves such arrays from its heap (no
# fresh pages to fault in), faster than the pool's look-up, lock and reference counts
POOL_MIN_BYTES = 1 << 16
# a product's rows are shared out in multiples of this many. OpenBLAS's kernels work on groups
# of rows, and a row computed in a group cut short can round differently: with 0.3.31's Haswell
# kernels (chosen on an AMD EPYC) cuts at any row changed bits, cuts at multiples of 4 (float64)
# or 24 (float32) did not. 48 is a multiple of every group size seen
ROW_ALIGN = 48

_pool: dict = {}
_pool_lock = threading.Lock()
_threads: int | None = None
_executor: ThreadPoolExecutor | None = None
_blas_limit = None  # threadpoolctl's handle while mpipar holds BLAS at one thread


def _forget_threads_after_fork() -> None:
    """A forked child has none of its parent's threads: start a pool of its own on demand
    (submitting to the parent's would wait forever)."""
    global _executor, _pool_lock
    _executor = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


def _threads_from_environment() -> int:
    mine = kernel_threads_setting()
    if mine is not None:
        return mine
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def kernel_threads() -> int:
    """The threads a rank's kernels run on: MPIPAR_KERNEL_THREADS, else OMP_NUM_THREADS or
    OPENBLAS_NUM_THREADS (``mpipar.threads`` sets them to the rank's share of the node's cores
    before NumPy loads), else every core this process may run on. Decided on first use; with
    more than one, NumPy's BLAS is held at one thread from then on (``set_kernel_threads``)."""
    if _threads is None:
        set_kernel_threads(_threads_from_environment())
    return _threads


def set_kernel_threads(n: int) -> None:
    """Run the kernels on ``n`` threads from now on. With n > 1 NumPy's BLAS is held at one
    thread (threadpoolctl) so that the two pools do not share the cores; with n = 1 it gets
    back the threads it had, and products are BLAS's to thread again."""
    global _threads, _executor, _blas_limit
    n = int(n)
    if n < 1:
        raise ValueError(f"kernel threads must be >= 1, got {n} (MPIPAR_KERNEL_THREADS?)")
    if _executor is not None:
        _executor.shutdown(wait=True)
        _executor = None
    if _blas_limit is not None:
        _blas_limit.restore_original_limits()
        _blas_limit = None
    _threads = n
    if n > 1:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # a dependency of mpipar; without it BLAS keeps its own threads
            warnings.warn("threadpoolctl is not installed: BLAS keeps its threads beside "
                          f"mpipar's {n} kernel threads (slower; pip install threadpoolctl)",
                          RuntimeWarning, stacklevel=2)
            return
        _blas_limit = threadpool_limits(1, user_api="blas")


@contextmanager
def blas_threads(n: int):
    """NumPy's BLAS on ``n`` threads inside the block (to measure BLAS itself, say), then back
    to what mpipar holds it at."""
    kernel_threads()  # settle mpipar's own limit first, so that leaving restores it
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # then mpipar never changed BLAS's threads either (set_kernel_threads)
        yield
        return
    with threadpool_limits(n, user_api="blas"):
        yield


def _drain(fn, blocks) -> None:
    for block in blocks:  # a shared iterator: next() on it is atomic under the GIL
        fn(block)


def run_blocks(items, fn) -> None:
    """fn(item) for every block, on up to ``kernel_threads()`` threads (the caller among them),
    each taking the next block as it finishes one, so that a thread that started late or was
    descheduled takes fewer. Blocks write disjoint parts of the outputs, so the result does not
    depend on which thread ran which; an exception in any block is raised here, after every
    thread has stopped."""
    items = list(items)
    n = min(kernel_threads(), len(items))
    if n <= 1:
        for it in items:
            fn(it)
        return
    _thread_pool()
    blocks = iter(items)
    futures = [_thread_pool().submit(_drain, fn, blocks) for _ in range(n - 1)]
    try:
        _drain(fn, blocks)
    finally:
        for f in futures:
            if not f.cancel():  # not started (the threads were busy): nothing left to do
                f.result()


def _thread_pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(kernel_threads() - 1, thread_name_prefix="mpipar-kernel")
    return _executor


def split(n: int, parts: int, align: int = 1) -> list:
    """At most ``parts`` contiguous slices of range(n), as equal as integers allow (none empty),
    every cut at a multiple of ``align``."""
    parts = max(1, min(parts, n))
    bounds = sorted({n * i // parts // align * align for i in range(parts)} | {n})
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def row_blocks(xp, n_rows: int, row_len: int, block: int | None = None) -> list:
    """Slices of rows of about ``block`` (default BLOCK_ELEMENTS) elements each; when the array
    is big enough to share, as many as a multiple of the kernel threads, so that each thread
    gets the same work. One slice of everything on a GPU."""
    if xp is not np:
        return [slice(0, n_rows)]
    total = n_rows * max(1, row_len)
    nb = -(-total // max(1, block or BLOCK_ELEMENTS))
    t = kernel_threads()
    if t > 1 and total >= PARALLEL_MIN_ELEMENTS:
        nb = -(-nb // t) * t
    return split(n_rows, nb)


def head_blocks(xp, lead, per_head) -> list:
    """Index tuples over the leading (batch..., heads) axes ``lead`` of an attention tensor, each
    selecting a block of about BLOCK_ELEMENTS elements (``per_head`` each): several whole batch
    elements when their heads fit (fewer, longer NumPy calls: the Python between calls holds the
    GIL), else groups of one element's heads; as many blocks as a multiple of the kernel threads
    where the sizes allow. Everything at once on a GPU. Blocks are views (slices), so strided
    q/k/v need no copies."""
    if xp is not np or not lead:
        return [(Ellipsis,)]
    per = max(1, BLOCK_ELEMENTS // max(1, per_head))  # heads per block
    nh = lead[-1]
    t = kernel_threads()
    share = t > 1 and math.prod(lead) * per_head >= PARALLEL_MIN_ELEMENTS
    if len(lead) == 2 and per >= 2 * nh:
        nb = lead[0]
        blocks = -(-nb // (per // nh))
        if share:
            blocks = -(-blocks // t) * t
        return [(b, slice(None)) for b in split(nb, blocks)]
    outer = [()]
    for n in lead[:-1]:
        outer = [o + (i,) for o in outer for i in range(n)]
    groups = -(-nh // per)  # per batch element
    if share:
        while (len(outer) * groups) % t and groups < nh:
            groups += 1
    return [o + (s,) for o in outer for s in split(nh, groups)]


def matmul(xp, a, b, out, bias=None, accumulate=False):
    """``out = a @ b (+ bias)``, or ``out += a @ b`` with ``accumulate``, for 2-D arrays. On
    the CPU the rows of ``out`` are split across the kernel threads: one single-threaded BLAS
    product per share, the bias added (or the sum accumulated) while the share is in cache.
    Shares are cut at multiples of ``ROW_ALIGN`` rows, so the bits do not depend on the
    threads. ``a`` and ``out`` may be strided views (``x.T`` for a weight gradient)."""
    m = a.shape[0]
    t = (_threads or kernel_threads()) if xp is np else 1
    if t <= 1 or m < 2 * ROW_ALIGN or m * a.shape[1] * b.shape[1] < PARALLEL_MIN_MNK:
        # one product on the calling thread, without the closures (tiny models call this a lot)
        if accumulate:
            small = xp is np and out.nbytes < POOL_MIN_BYTES  # malloc's, not the pool's
            out += xp.matmul(a, b) if small else xp.matmul(a, b, out=empty(xp, out.shape,
                                                                             out.dtype))
        else:
            xp.matmul(a, b, out=out)
        if bias is not None:
            out += bias
        return out
    shares = split(m, t, ROW_ALIGN)
    scratch = empty(xp, out.shape, out.dtype) if accumulate else None

    def share(r):
        if accumulate:
            xp.matmul(a[r], b, out=scratch[r])
            out[r] += scratch[r]
        else:
            xp.matmul(a[r], b, out=out[r])
        if bias is not None:
            out[r] += bias

    run_blocks(shares, share)
    return out


def product(xp, a, b, bias=None):
    """``a @ b (+ bias)`` in a new array: ``matmul`` into ``empty``, and for a product on the
    calling thread whose output is below the pool's size, one ``matmul`` that allocates (the
    same BLAS call, so the same bits) with no look-ups: a small model's layers call this per
    micro-batch, where the Python calls around a product are much of its cost."""
    m, n = a.shape[0], b.shape[1]
    if xp is np and a.dtype == b.dtype and inline_product(m, a.shape[1], n, a.itemsize):
        out = np.matmul(a, b)
        if bias is not None:
            out += bias
        return out
    return matmul(xp, a, b, empty(xp, (m, n), a.dtype), bias=bias)


def inline_product(m, k, n, itemsize) -> bool:
    """Whether an (m, k) @ (k, n) NumPy product is made by one allocating ``matmul`` on the
    calling thread (``product``'s small branch; below the pool's size ``matmul``'s
    single-thread accumulation too): its output under the pool's size, and too small or too
    short to share among the kernel threads. ``nn.dense`` asks the same question."""
    t = _threads or kernel_threads()
    return (m * n * itemsize < POOL_MIN_BYTES
            and (t <= 1 or m < 2 * ROW_ALIGN or m * k * n < PARALLEL_MIN_MNK))


def empty(xp, shape, dtype):
    """An uninitialised array, on the CPU reused from earlier calls when nothing else refers to
    it any more (CPython's reference count says so: a saved context, a view or a caller holding
    it keeps it out of reach). Fresh multi-megabyte arrays cost page faults on every step;
    reused ones are already mapped. The lock keeps two kernel threads from being handed the
    same buffer. CuPy has its own pool."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize < POOL_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    key = (tuple(shape), dtype.str)
    with _pool_lock:
        bufs = _pool.setdefault(key, [])
        for buf in bufs:
            if sys.getrefcount(buf) == 3:  # bufs, the loop variable, getrefcount's argument
                return buf
        buf = np.empty(shape, dtype=dtype)
        if len(bufs) < POOL_PER_SHAPE:
            bufs.append(buf)
        return buf


def clear_pool() -> None:
    """Forget the reusable buffers (frees them once nothing else holds them)."""
    with _pool_lock:
        _pool.clear()
