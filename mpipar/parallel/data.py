"""Data parallelism: bucketed, overlapped gradient all-reduce, and ZeRO-1 optimizer sharding.

Each chunk's gradients live in a few flat buckets (``param.grad`` becomes a view into one), so a
bucket is reduced with one collective. A chunk's buckets start reducing (non-blocking) as soon as
its last micro-batch's weight gradient is done, while the rest of the backward goes on; ``finish``
waits for all of them. Buckets are filled in reverse layer order, the order backward finishes them
(as PyTorch DDP and Megatron do). All buckets' gradients come from one collective
``registered_zeros`` on the dp group: where its ranks share a node they live in a shared window
(Megatron's contiguous gradient buffer, registered), and the reductions read them in place.

ZeRO-1 (Rajbhandari et al., 2020, stage 1): each bucket's gradient is reduce-scattered instead of
all-reduced; each dp rank keeps optimizer state for, and updates, only its 1/dp slice of the
bucket; the updated slices are all-gathered back into the parameters. Buckets never mix
parameters that decay with those that do not, nor tp-replicated with tp-sharded ones, so each
slice is a plain parameter for the optimizer and for the gradient-norm count.
"""

from __future__ import annotations

from ..backend import array_module
from ..nn.optim import counts_in_norm, decays
from ..nn.params import REPLICATED, ShardSpec


def padded_size(params, pad_to) -> int:
    """A bucket's elements: its parameters', rounded up to a multiple of ``pad_to``."""
    return -(-sum(p.size for p in params) // pad_to) * pad_to


class Bucket:
    """Parameters whose gradients live in one flat array ``grad`` (zeros, ``padded_size``)."""

    def __init__(self, params, grad):
        self.params = list(params)
        self.numel = sum(p.size for p in self.params)
        self.padded = grad.size
        self.grad = grad
        off = 0
        for p in self.params:
            view = self.grad[off:off + p.size].reshape(p.shape)
            view[...] = p.grad
            p.grad = view  # gradients accumulate straight into the bucket
            off += p.size
        self.request = None
        self.launched = False
        self.distinct = len({id(p) for p in self.params})
        self.waiting = self.distinct  # parameters not yet final this step (unit_ready)


class FlatShard:
    """This dp rank's slice of a ZeRO-1 bucket, shaped like a parameter for the optimizer."""

    def __init__(self, name, data, grad, decay, replicated, tp_rank):
        self.name, self.data, self.grad = name, data, grad
        self.decay = decay  # read by optim.decays(): the bucket holds parameters of one role
        self.full_shape = (1, data.size) if decay else (data.size,)
        self.spec = REPLICATED if replicated else ShardSpec(axis=0)
        self.tp_rank = tp_rank

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self):
        return int(self.data.size)

    def zero_grad(self):
        self.grad.fill(0)


def sync_partial_grads(params, tp) -> None:
    """All-reduce over tp the gradients that sequence parallelism leaves partial (LayerNorm,
    row-parallel biases, positions): each tp rank saw only its slice of the sequence. ``tp``: the
    tensor-parallel context (its ``size`` and ``comm``); which gradients are partial is the
    parameters' own spec (``ShardSpec.partial_grad``). This step of the gradient
    synchronisation lives here, beside the dp reduction it precedes, so that the data axis
    does not import the tensor axis.

    They are small and many (two LayerNorms and two biases per block), so they travel together
    in one flat buffer: one collective per call instead of one per tensor.
    """
    if tp.size == 1:
        return
    partial = [p for p in params if p.spec.partial_grad]
    if not partial:
        return
    xp = array_module(partial[0].grad)
    flat = xp.concatenate([p.grad.reshape(-1) for p in partial])
    tp.comm.allreduce(flat, op="sum", inplace=True)
    off = 0
    for p in partial:
        p.grad[...] = flat[off:off + p.size].reshape(p.grad.shape)
        off += p.size


class GradSync:
    """Gradient synchronisation of one step: sequence-parallel partial sums over tp, then the
    data-parallel reduction over ``comm`` (a communicator of size 1 when dp = 1).

    ``chunk_params``: {chunk index: [Parameter, ...] in forward order}; ``tp``: the
    ``TPContext`` whose partial gradients are summed before a bucket leaves. The executor's
    callbacks are this object's methods: ``unit_ready`` (on_unit_ready) and ``chunk_ready``
    (on_grads_ready); ``finish`` reports whatever chunk the executor did not.
    """

    def __init__(self, chunk_params: dict, comm, backend, tp, bucket_mb=4.0, overlap=True,
                 zero1=False):
        self.comm, self.backend, self.tp = comm, backend, tp
        self.chunk_params = chunk_params
        self.dp = comm.size
        self.overlap, self.zero1 = overlap and self.dp > 1, zero1 and self.dp > 1
        # nothing to sum over tp nor to reduce over dp (one rank, a pipeline-only grid): a step
        # needs none of start / chunk_ready / finish / after_step, and a small model's step
        # pays for every function it enters (BENCHMARKS.md, "Ninth cuts")
        self.idle = self.dp == 1 and tp.size == 1
        xp, dtype = backend.xp, backend.dtype
        limit = max(1, int(bucket_mb * 2**20 / dtype().itemsize))
        groups_of = {}  # chunk -> [[Parameter, ...] of one bucket]
        for c, params in chunk_params.items():
            groups = {}
            for p in reversed(params):  # backward finishes the last layers first
                key = (decays(p), p.spec.axis is None) if self.zero1 else None
                groups.setdefault(key, []).append(p)
            out = []
            for group in groups.values():
                cur, size = [], 0
                for p in group:
                    if cur and size + p.size > limit:
                        out.append(cur)
                        cur, size = [], 0
                    cur.append(p)
                    size += p.size
                if cur:
                    out.append(cur)
            groups_of[c] = out
        # every bucket's gradient in one collective allocation: registered buffers of one shared
        # window where the dp ranks share a node (host arrays), so the dp all-reduce and ZeRO-1's
        # reduce-scatter reduce them where they are, with no copy in or out (mpi/windows.py)
        pad = self.dp if self.zero1 else 1
        flat = [g for c in groups_of for g in groups_of[c]]
        grads = iter(comm.registered_zeros([padded_size(g, pad) for g in flat], dtype, xp))
        self.buckets = {c: [Bucket(g, next(grads)) for g in gs] for c, gs in groups_of.items()}
        self.shards = self._make_shards() if self.zero1 else []
        # the step's bookkeeping, in one place: chunks whose gradients are final, and the
        # parameters already final (tp partial sums done) before their chunk is
        self._done = set()
        self._final = set()
        # id(parameter) -> the buckets holding it, and each unit's parameters, made once:
        # unit_ready runs per unit and step, and counting down a bucket's waiting parameters
        # spares it a scan of every bucket's parameters per unit
        self._buckets_of = {}
        for bs in self.buckets.values():
            for b in bs:
                for i in {id(p) for p in b.params}:
                    self._buckets_of.setdefault(i, []).append(b)
        self._unit_params = {}  # id(unit) -> (unit, its parameters, their ids)
        # chunks whose units are worth reporting one by one: a chunk in one bucket cannot start
        # it before its last unit is done, which chunk_ready reports anyway (a small model's
        # whole gradient is one bucket), unless tp partial sums overlap the backward per unit
        self._unit_wise = {c: len(bs) > 1 or tp.size > 1 for c, bs in self.buckets.items()}
        self._outside = {}  # id(params list) -> (list, its parameters outside every bucket)

    # -- ZeRO-1 state
    def _make_shards(self):
        shards = []
        r = self.comm.rank
        for c, buckets in sorted(self.buckets.items()):
            for i, b in enumerate(buckets):
                k = b.padded // self.dp
                b.flat_data = self.backend.xp.zeros(b.padded, dtype=self.backend.dtype)
                off = 0
                for p in b.params:
                    b.flat_data[off:off + p.size] = p.data.reshape(-1)
                    p.data = b.flat_data[off:off + p.size].reshape(p.shape)
                    off += p.size
                p0 = b.params[0]
                b.shard = FlatShard(f"zero1.chunk{c}.bucket{i}.dp{r}",
                                    b.flat_data[r * k:(r + 1) * k],
                                    self.backend.xp.zeros(k, dtype=self.backend.dtype),
                                    decays(p0), p0.spec.axis is None, p0.tp_rank)
                shards.append(b.shard)
        return shards

    def optimizer_params(self, params):
        """What the optimizer should update on this rank: the parameters, or ZeRO-1's slices."""
        return self.shards if self.zero1 else list(params)

    # -- the step
    def zero_grads(self, params) -> None:
        """Zero the gradients of ``params``: one fill per bucket (every parameter's gradient is
        a view into one), then any parameter outside the buckets, one by one."""
        for buckets in self.buckets.values():
            for b in buckets:
                b.grad.fill(0)
        outside = self._outside.get(id(params))
        if outside is None or outside[0] is not params:
            held = set(self._buckets_of)
            outside = self._outside[id(params)] = (params, [p for p in params
                                                            if id(p) not in held])
        for p in outside[1]:
            p.zero_grad()

    def start(self) -> None:
        self._done = set()
        self._final = set()
        for buckets in self.buckets.values():
            for b in buckets:
                b.launched = False
                b.waiting = b.distinct

    def unit_ready(self, c, unit) -> None:
        """The executor's ``on_unit_ready``: during chunk c's last backward, ``unit``'s gradients
        are final. Sum its partial gradients over tp, then start every bucket of c now complete
        (only registered when buckets overlap the backward)."""
        if c in self._done or not self._unit_wise.get(c, True):
            return
        entry = self._unit_params.get(id(unit))
        if entry is None or entry[0] is not unit:
            ps = unit.params()
            entry = self._unit_params[id(unit)] = (unit, ps, [id(p) for p in ps])
        sync_partial_grads(entry[1], self.tp)
        final = self._final
        for i in entry[2]:
            if i in final:
                continue
            final.add(i)
            for b in self._buckets_of.get(i, ()):
                b.waiting -= 1
                if b.waiting == 0 and self.overlap and not b.launched:
                    self._launch_bucket(b)

    def chunk_ready(self, c) -> None:
        """The executor's ``on_grads_ready``: chunk c's gradients are final for this step. Sum
        the partial gradients over tp not yet summed, then start c's buckets (in this order: the
        dp reduction runs in the background on the same buffers)."""
        if c in self._done:
            return
        self._done.add(c)
        if self.tp.size > 1:  # else nothing is partial (sync_partial_grads: no work)
            sync_partial_grads([p for p in self.chunk_params[c] if id(p) not in self._final],
                               self.tp)
        if self.overlap:
            self._launch(c)

    def reduce_now(self, c) -> None:
        """Asynchronous PipeDream: chunk c's gradient of one micro-batch, summed over tp and
        averaged over dp at once (blocking), for the update that follows: one collective per
        flat bucket of c (every parameter's gradient is a view into one), the buckets and the
        reduction of the flushing path's ``finish``, not one per parameter."""
        sync_partial_grads(self.chunk_params[c], self.tp)
        if self.dp > 1:
            for b in self.buckets.get(c, ()):
                self.comm.allreduce(b.grad, op="mean", inplace=True)

    def _launch(self, c):
        for b in self.buckets[c]:
            if not b.launched:
                self._launch_bucket(b)

    def _launch_bucket(self, b):
        b.launched = True
        if self.zero1:  # this rank's slice of the sum, into the shard's gradient
            b.request = self.comm.ireduce_scatter(b.grad, b.shard.grad, op="sum")
        else:
            b.request = self.comm.iallreduce(b.grad, op="mean")

    def finish(self) -> None:
        """Report the chunks the executor did not, then complete every bucket's reduction
        (launching those not yet started)."""
        for c in self.buckets:
            self.chunk_ready(c)
        if self.dp == 1:
            return
        for c in self.buckets:
            self._launch(c)
        for buckets in self.buckets.values():
            for b in buckets:
                if b.request is not None:
                    b.request.wait()
                    b.request = None
                if self.zero1:
                    b.shard.grad *= 1.0 / self.dp

    def after_step(self) -> None:
        """ZeRO-1: gather every rank's updated slice back into the full parameters."""
        if not self.zero1:
            return
        for buckets in self.buckets.values():
            for b in buckets:
                self.comm.allgather(b.shard.data, axis=0, out=b.flat_data)

    def norm_params(self, params):
        """The tensors whose squares make up this rank's share of the gradient norm."""
        return self.shards if self.zero1 else [p for p in params if counts_in_norm(p)]

    # -- checkpoints: ZeRO-1 optimizer state back to per-parameter tensors
    def gather_state(self, opt_state: dict, buffers) -> dict:
        """{param name: {buffer: array in the parameter's shard shape}} from the slices' state."""
        out = {}
        for buckets in self.buckets.values():
            for b in buckets:
                flats = {name: self.comm.allgather(opt_state[b.shard.name][name], axis=0)
                         for name in buffers}
                off = 0
                for p in b.params:
                    out[p.name] = {name: flats[name][off:off + p.size].reshape(p.shape)
                                   for name in buffers}
                    off += p.size
        return out

    def scatter_state(self, per_param: dict, buffers) -> dict:
        """The inverse of ``gather_state``: this rank's slice state from per-parameter tensors."""
        xp = self.backend.xp
        out = {}
        r = self.comm.rank
        for buckets in self.buckets.values():
            for b in buckets:
                k = b.padded // self.dp
                entry = {}
                for name in buffers:
                    flat = xp.zeros(b.padded, dtype=self.backend.dtype)
                    off = 0
                    for p in b.params:
                        flat[off:off + p.size] = xp.asarray(per_param[p.name][name]).reshape(-1)
                        off += p.size
                    entry[name] = flat[r * k:(r + 1) * k].copy()
                out[b.shard.name] = entry
        return out
