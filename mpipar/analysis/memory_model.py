"""Bytes each pipeline rank holds at its peak, from the config and the simulated schedule.

What it predicts is what the trainer measures (``mpipar.training.memory``): the state a step
keeps (counted exactly there) plus the resident high-water mark the steps add above set-up.
Per rank ``p``, in values of the dtype (``s`` bytes) unless said, with ``P`` its parameters
(its shard under tp), ``T = b S`` the tokens of one micro-batch (``b`` rows, sequence ``S``),
``d`` width, ``H`` heads, ``V`` vocabulary:

- **state**: parameters ``P``; gradients ``P`` (flat buckets, padded to a multiple of dp with
  ZeRO-1, which adds this rank's gradient slice ``P / dp``); optimizer state ``k P`` (AdamW
  k = 2, SGD with momentum 1), ``/ dp`` with ZeRO-1.
- **activations**: the simulator's peak of live (micro-batch, chunk) pairs times what one pair
  leaves in the layers' saved contexts (``block_stored``; tests/test_memory_model.py measures it
  in the ``_ctx`` of a real block). The last chunk also keeps the loss's softmax and the logits'
  gradient (``2 V / tp`` per token) from its forward to its backward. Full recomputation keeps
  only each pair's chunk input (token ids on the first: 8 bytes each) plus one pair's whole
  context, rebuilt before its backward; selective drops the attention probabilities (``H S``).
- **backward**: where B and W are separate actions, a chunk's backward-input keeps every
  layer's output gradient until its weight pass (``block_retained``: 4 ``(T, d)`` gradients and
  the fused ``dqkv``); a BW action runs each unit's two passes together, so only its first
  (the chunk's last unit) keeps them on top of the stored contexts; the buffers of a
  block that the backward lets go (GELU's, attention's) go back to ``nn.cpu``'s pool and are
  reused by the next block, so the retained gradients pile up and the rest does not.
- **working set**: ``nn.cpu``'s pool keeps, per array shape, as many buffers as were ever alive
  together, so a rank holds at its peak one set of the transient buffers of its largest unit on
  top: ``block_work`` (the MLP backward's two ``(T, 4d/tp)`` gradients, a few ``(T, d)`` sums
  and residual outputs), the head's logits ``V / tp`` and the weight-gradient scratch of each
  weight shape (``cpu.matmul`` accumulates through one), the optimizer's scratch.
- **buffers**: the receive pool, ``RECV_WINDOW + 1`` boundary activations per direction a rank
  receives in, and up to ``SEND_BACKLOG + 1`` outputs waiting on their sends; with dp > 1 the
  scratch of the gradient reductions (``dp_scratch``): mpipar's own all-reduce and
  reduce-scatter algorithms work in host buffers of power-of-two sizes, one set per bucket in
  flight (a chunk's buckets all start together); the shared-memory one reduces the buckets where
  they live (registered buffers) and maps this rank's block of every other rank's bucket; the
  library's own (wherever ``mpipar.mpi.tuning`` chooses it) are MPI's business and not counted.

- **prefetch** (pp > 1, flushing schedules): the next step's batch, read at the rank's first
  wait of a step and held to the next (``prefetch_bytes``).

- **trace** (when the caller gives the events a rank records per step, as ``predict`` does from
  a dump): the timing dump's cost to the rank (``trace_bytes``). The tracer keeps each event as
  a Python tuple until the next flush (``run.flush_interval`` steps; 0: the end of the run),
  about ``TRACE_EVENT_BYTES`` each, and the HDF5 part writer keeps ``DUMP_WRITER_BYTES`` of its
  own once it has written. Both measured on this machine by ``python experiments/memory_runtime.py``
  (one process, no MPI; rerun it and copy its fit on another machine).

- **runtime** (``with_runtime``): what MPI, BLAS and the allocator first touch during the
  steps, which nothing in the config sizes; per rank, measured once per machine as what a tiny
  traced pp = 2 run's ranks touched beyond this model's prediction of them (the probe of
  ``mpipar plan measure``, ``plan.measure.runtime_bytes``): ``RUNTIME_BYTES`` here, a spec's
  ``runtime_mb`` for a planned cluster. ``python experiments/memory_runtime.py --runtime``
  measures it (rerun it and copy the number on another machine).

Not counted: PipeDream's weight stashes, 2BW's older copy of the weights, evaluation (forward
only: it holds less than a training step).
"""

from __future__ import annotations

from types import SimpleNamespace

from ..models import GPTDims, gpt_counts, stage_bounds
from ..models.counts import block_counts, boundary_values
from ..nn.cpu import BLOCK_ELEMENTS  # AdamW's per-thread scratch is at most one block
from ..parallel.pipeline.inflight import RECV_WINDOW, SEND_BACKLOG
from ..parallel.tp_split import TPSplit
from .flops import model_kind
from .flops import model_section as _model
from .flops import setting as get

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# measured by experiments/memory_runtime.py on this machine (the fit it prints)
TRACE_EVENT_BYTES = 303  # one recorded event held until the next flush
DUMP_WRITER_BYTES = 1 << 20  # the HDF5 part writer's own, once it has written
# measured by ``experiments/memory_runtime.py --runtime`` on this machine (module doc: runtime)
RUNTIME_BYTES = 646_400  # per rank: MPI, BLAS, allocator, touched during the steps


def with_runtime(rows: list[dict] | None, runtime: float = RUNTIME_BYTES) -> list[dict] | None:
    """``rows`` (``rank_memory``'s or ``predict_run``'s) with each rank's ``runtime`` part
    (bytes; this machine's by default, a planned cluster's from its spec) in its total."""
    if rows is None:
        return None
    for row in rows:
        row["runtime"] = int(runtime)
        row["total"] += row["runtime"]
    return rows


def trace_bytes(config: dict, events_per_step: float) -> int:
    """The timing dump's resident cost to a rank recording ``events_per_step``, by its last
    recorded peak (``mem.peak``, taken inside each step; a flush comes after the step): the
    events held since the last flush, and the writer's own once a flush came before it. With
    flushes every ``run.flush_interval`` steps, fewer than ``train.steps``: that many steps'
    events and the writer; else (0, or no flush before the end) every step's and no writer."""
    if get(config, "trace", True) is False:
        return 0
    steps = int(get(config, "steps", 1) or 1)
    every = int(get(config, "flush_interval", 50) or 0)
    if 0 < every < steps:
        return int(events_per_step * every * TRACE_EVENT_BYTES) + DUMP_WRITER_BYTES
    return int(events_per_step * steps * TRACE_EVENT_BYTES)


def _block_counts(d: int, heads: int, seq: int, tp: int, sp: bool, selective: bool = False):
    dims = GPTDims(n_layer=1, n_embd=d, n_head=heads, vocab_size=tp, block_size=seq)
    return block_counts(dims, TPSplit.of("1d", tp, sequence_parallel=sp), seq, selective)


def block_stored(d: int, heads: int, seq: int, tp: int = 1, sp: bool = False) -> float:
    """Values per token one GPT block keeps in its saved contexts for one micro-batch, 1d tp
    (``models.counts``: x-hat and the output of each LayerNorm, q/k/v, the probabilities H S,
    the attention output, the MLP's pre-activation, tanh and GELU output)."""
    return _block_counts(d, heads, seq, tp, sp).stored


def split_of(config: dict, grid: dict) -> TPSplit:
    """The tp cut of the run (``parallel.tp_mode``, ``tp_depth``, sequence parallelism)."""
    return TPSplit.of(str(get(config, "tp_mode", "1d") or "1d"), int(grid.get("tp", 1)),
                      int(get(config, "tp_depth", 1) or 1),
                      bool(get(config, "sequence_parallel")))


def _units_gpt(m: dict, split: TPSplit, b: int, seq: int, s: int, selective: bool):
    """[(params, stored, retained, work, weight scratch, attention probabilities)] per unit
    (``models.counts``, times the tokens of a micro-batch), and the boundary values."""
    dims = GPTDims.of({"block_size": seq, **m})
    tok = b * seq
    units = [(int(u.params), tok * (u.stored + u.id_bytes / s), tok * u.retained, tok * u.work,
              u.scratch, tok * u.core) for u in gpt_counts(dims, split, seq, selective)]
    return units, tok * boundary_values(dims, split)


def _units_mlp(m: dict, b: int):
    """Per layer: the input kept, and the output where the layer keeps it beyond the next
    layer's input (GELU's pre-activation; the head's output, which the loss keeps as its
    softmax): a ReLU keeps its output, which is the next linear's input; the output gradient
    until W."""
    sizes = [int(x) for x in m.get("sizes", [])]
    relu = m.get("activation", "relu") == "relu"
    last = len(sizes) - 2
    units = [(a * o + o, b * (a if relu and i < last else a + o), b * o, 2 * b * o, a * o, 0)
             for i, (a, o) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))]
    return units, b * (max(sizes) if sizes else 0)


def _dims(config: dict, grid: dict):
    tp, dp = int(grid.get("tp", 1)), int(grid.get("dp", 1))
    mb = int(get(config, "microbatches", 1) or 1)
    b = max(int(get(config, "batch_size", 1) or 1) // (mb * dp), 1)
    seq = int(get(config, "seq_len", 1) or get(config, "block_size", 1) or 1)
    return tp, b, seq


def _units(config: dict, grid: dict):
    kind = model_kind(config)
    m = _model(config)
    _, b, seq = _dims(config, grid)
    s = DTYPE_BYTES.get(str(get(config, "dtype", "float32")), 4)
    try:
        if kind == "gpt":
            return _units_gpt(m, split_of(config, grid), b, seq, s,
                              _recompute(config) == "selective")
        if kind == "mlp":
            return _units_mlp(m, b)
    except (KeyError, TypeError, ValueError):
        pass
    return None


def chunk_bounds(config: dict, grid: dict, virtual_stages: int) -> dict | None:
    """{chunk: (first unit, end unit)} as the trainer cuts the model (``models.stage_bounds``:
    ``parallel.layout``, else ``parallel.partition``); None when the model kind is unknown."""
    kind = model_kind(config)
    if kind not in ("gpt", "mlp"):
        return None
    mcfg = SimpleNamespace(**{"sizes": [], "n_layer": 0, **_model(config), "kind": kind})
    pcfg = SimpleNamespace(layout=str(get(config, "layout", "") or ""),
                           partition=str(get(config, "partition", "uniform")),
                           boundaries=list(get(config, "boundaries", []) or []))
    return stage_bounds(mcfg, pcfg, int(grid["pp"]), virtual_stages)


def _recompute(config: dict) -> str:
    r = str(get(config, "recompute", "none")).lower()
    return {"true": "full", "false": "none"}.get(r, r)


def _activations(recompute, live, chunks, bounds, units, boundary, split=True, order=None):
    """Values held by live pairs plus the backward's retained gradients of the largest chunk
    (selective recomputation drops each unit's attention probabilities). ``split``: the rank
    runs B and W as separate actions. A BW action runs each unit's two passes together
    (``Sequential.backward``): on top of every stored context sit only the gradients of the
    chunk's last unit, the first it runs; each later unit frees its own context as it goes.
    ``order``: the rank's actions; with several chunks the live pairs are weighed by their
    own chunk's values along it (``_weighted_peak``), not ``live`` times the chunks' mean."""
    span = {c: range(*bounds[c]) for c in chunks}
    stored = [sum(units[i][1] for i in span[c]) for c in chunks]
    if split:
        retained = max((sum(units[i][2] for i in span[c]) for c in chunks), default=0)
    else:
        retained = max((units[span[c][-1]][2] for c in chunks if span[c]), default=0)
    if not stored:
        return 0
    if recompute == "full":
        inputs = [(units[0][1] if bounds[c][0] == 0 else boundary) for c in chunks]
        return _weighted_peak(live, chunks, inputs, order) + max(stored) + retained
    if recompute == "selective":
        stored = [st - sum(units[i][5] for i in span[c]) for st, c in zip(stored, chunks)]
    return _weighted_peak(live, chunks, stored, order) + retained


def _weighted_peak(live, chunks, held, order) -> float:
    """The most values the live (micro-batch, chunk) pairs hold at once: along the rank's
    ``order`` (the simulator's count: F adds a pair, W or BW releases it), each pair its own
    chunk's ``held``; one chunk (or no order): ``live`` pairs of its mean. An interleaved rank
    holds its chunks' pairs unevenly (tiny GPT, pp = 2, v = 2: rank 1 peaks on three pairs of
    its two-block chunk, not on three of the mean of that and the head's)."""
    if order is None or len(chunks) < 2:
        return live * sum(held) / len(held)
    of = dict(zip(chunks, held, strict=True))
    now = peak = 0.0
    for a in order:
        if a.op == "F":
            now += of.get(a.chunk, 0.0)
            peak = max(peak, now)
        elif a.op in ("W", "BW"):
            now -= of.get(a.chunk, 0.0)
    return peak


def rank_memory(config: dict, grid: dict, schedule, peak_activations, bounds,
                events_per_step=None) -> list[dict] | None:
    """Predicted bytes per pipeline rank: params, grads, optimizer, activations, work, buffers,
    (trace,) total (the sum). ``bounds``: {chunk: (first unit, end unit)}. None when the model
    kind is unknown. ``events_per_step[p]``: the events pipeline rank p records per step (from
    a dump): adds the ``trace`` part (``trace_bytes``)."""
    found = _units(config, grid)
    if found is None or bounds is None:
        return None
    units, boundary = found
    dp = int(grid.get("dp", 1))
    s = DTYPE_BYTES.get(str(get(config, "dtype", "float32")), 4)
    recompute = _recompute(config)
    opt = str(get(config, "optimizer", "adamw"))
    k = 2 if opt == "adamw" else (1 if float(get(config, "momentum", 0) or 0) else 0)
    zero = dp if get(config, "zero1") and dp > 1 else 1
    out = []
    for p, actions in enumerate(schedule.ranks):
        chunks = sorted({a.chunk for a in actions} | {c for c in bounds if c % schedule.pp == p})
        held = [units[i] for c in chunks for i in range(*bounds[c])]
        n = sum(u[0] for u in held)
        live = peak_activations[p] if p < len(peak_activations) else 0
        split = any(a.op in ("B", "W") for a in actions)
        act = _activations(recompute, live, chunks, bounds, units, boundary, split, actions)
        scratch = sum({u[4] for u in held}) + min(max((u[0] for u in held), default=0),
                                                  BLOCK_ELEMENTS)
        work = max((u[3] for u in held), default=0) + scratch
        per_chunk = [sum(units[i][0] for i in range(*bounds[c])) for c in chunks]
        row = {"params": s * n, "grads": s * (n + (n // zero if zero > 1 else 0)),
               "optimizer": k * s * n // zero, "activations": int(s * act),
               "work": int(s * work), "buffers": int(s * boundary * _buffers(schedule, p))
               + dp_scratch(per_chunk, dp, zero > 1, s, float(get(config, "bucket_mb", 4.0)))}
        read_ahead = prefetch_bytes(config, grid, schedule.pp, 0 in chunks)
        if read_ahead:
            row["prefetch"] = read_ahead
        if events_per_step is not None:
            row["trace"] = trace_bytes(config, events_per_step[p])
        row["total"] = sum(row.values())
        out.append(row)
    return out


def prefetch_bytes(config: dict, grid: dict, pp: int, first: bool) -> int:
    """The next step's batch a pipeline rank reads at its first wait of a step and holds
    from there, near its peak (after the warm-up forwards on the first stage), to the next step
    (``training.steps.Step._prefetch``): with pp > 1 and a flush per step (a continuous run
    feeds its steps itself), over more than one step. Its inputs on the rank of the first chunk
    (``first``; an MLP's other ranks keep a view of one row), its targets on every rank; a GPT's
    token ids (int64) both ways everywhere."""
    if pp <= 1 or get(config, "continuous") or int(get(config, "steps", 2) or 2) < 2:
        return 0
    _, b, seq = _dims(config, grid)
    rows = b * int(get(config, "microbatches", 1) or 1)
    kind = model_kind(config)
    if kind == "gpt":
        return 2 * rows * seq * 8
    if kind != "mlp":
        return 0
    m = _model(config)
    sizes = [int(x) for x in m.get("sizes", [])]
    s = DTYPE_BYTES.get(str(get(config, "dtype", "float32")), 4)
    if not sizes:
        return 0
    regression = m.get("task", "classification") == "regression"
    targets = rows * (sizes[-1] * s if regression else 8)
    return targets + (rows * sizes[0] * s if first else 0)


def _pow2(nbytes: float) -> int:
    """The capacity ``mpi.staging.HostBufferPool`` gives a request of ``nbytes``."""
    return max(4096, 1 << max(0, int(nbytes) - 1).bit_length())


def dp_scratch(chunk_params: list, dp: int, zero1: bool, s: int, bucket_mb: float) -> int:
    """Host scratch bytes of the data-parallel reductions of a rank's gradient buckets (each
    chunk's parameters cut into buckets of ``bucket_mb`` MiB, all in flight at once). Per bucket
    of n bytes: a ring all-reduce n / dp, Rabenseifner's n; ZeRO-1's reduce-scatter copies its
    input (n + n / dp) and works in n (Rabenseifner) or n / dp (ring); the all-gather works in
    place. The buckets are registered buffers (``mpi/windows.py``: one shared window where
    the dp ranks share a node), so the shared-memory algorithm (``shm``, where the tuning has it)
    copies nothing: it reads and writes block r of every other rank's bucket there, and those
    pages stay mapped, resident in this rank too: (dp - 1) / dp of each bucket. The algorithm is
    the one ``mpipar.mpi.tuning`` picks for that size and a registered buffer."""
    if dp <= 1:
        return 0
    from mpipar.mpi.tuning import REGISTERED, choose  # pure: no MPI is loaded by importing it

    limit = max(1, int(bucket_mb * 2**20 / s))
    total = 0
    for n_params in chunk_params:
        sizes = [limit] * (n_params // limit) + ([n_params % limit] if n_params % limit else [])
        for size in sizes:
            n = -(-size // dp) * dp * s if zero1 else size * s
            kind = "reduce_scatter" if zero1 else "allreduce"
            algo = choose(REGISTERED[kind], n, dp)
            if algo == "shm":  # the others' blocks r of this bucket, mapped here
                total += n * (dp - 1) // dp
            elif algo != "library":
                tmp = n if algo == "rabenseifner" else n // dp
                total += _pow2(tmp) + (_pow2(n + n // dp) if zero1 else 0)
    return total


def _buffers(schedule, p: int) -> int:
    """Boundary activations in the receive pool and waiting on sends on rank ``p``."""
    if schedule.pp == 1:
        return 0
    ops = {a.op for a in schedule.ranks[p]}
    recv = sum(1 for op in ("RECV_F", "RECV_B") if op in ops) * (RECV_WINDOW + 1)
    sends = sum(1 for a in schedule.ranks[p] if a.op in ("SEND_F", "SEND_B"))
    return recv + min(sends, SEND_BACKLOG + 1)


def predict_run(config: dict, grid: dict, events_per_step=None) -> list[dict] | None:
    """``rank_memory`` for a config alone: the schedule built and simulated here
    (``events_per_step``: as ``rank_memory`` takes it, from a dump of the run)."""
    from mpipar.parallel.pipeline.generators import build_schedule
    from mpipar.parallel.pipeline.simulate import simulate

    pp = int(grid.get("pp", 1))
    v = int(get(config, "virtual_stages", 1) or 1)
    m = int(get(config, "microbatches", 1) or 1)
    sched = build_schedule(str(get(config, "schedule", "1f1b")), pp, m, virtual_stages=v)
    return rank_memory(config, grid, sched, simulate(sched).peak_activations,
                       chunk_bounds(config, grid, v), events_per_step)
