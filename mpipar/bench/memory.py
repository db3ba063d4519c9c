"""Memory of one training step: an analytic count beside what tracemalloc sees.

Analytic count (float32, 4 bytes; T = batch * seq tokens, l layers, width d, H heads, S = seq,
V = vocab; P = parameters):

* resident: parameters, gradients and AdamW's two moments: 4 P values;
* activations held between forward and backward, per layer and token: 20 d + H S + 2 values
  (``mpipar.analysis.memory_model.block_stored``: LN1 x-hat and output 2d, fused QKV 3d,
  attention output d, LN2 x-hat and output 2d, MLP pre-activation, tanh and GELU output 12d; the
  softmax probabilities H S; two LayerNorm deviations), plus 2 d + V per token after the last
  layer (final LN, softmax of the logits). The memory model of a whole step (what the trainer
  measures: gradients held in the backward, the pool's working set) is
  ``mpipar.analysis.memory_model``; this bench counts one step of one rank.

Measured: tracemalloc's peak of new allocations during one step (NumPy reports its buffers to
tracemalloc) plus the resident arrays, which exist before the step; mpipar's buffer pool is
emptied first so that the step allocates (and is charged for) all its buffers. On a GPU (CuPy):
the bytes CuPy's memory pool holds after a step (the pool keeps freed blocks, so this is its
high-water mark since the model was built) minus the resident arrays, as the step peak.
"""

from __future__ import annotations

import tracemalloc


def analytic_bytes(sh, n_params: int, itemsize: int = 4) -> dict:
    from mpipar.analysis.memory_model import block_stored

    t, d, layers = sh.tokens, sh.n_embd, sh.n_layer
    resident = 4 * n_params * itemsize
    block = block_stored(d, sh.n_head, sh.seq)
    act = int(t * (layers * block + 2 * d + sh.vocab_size) * itemsize)
    return {"resident": resident, "activations": act, "total": resident + act}


def measured_bytes(step, model, opt, xp=None) -> dict:
    """Run ``step`` once under tracemalloc (slow: do it after timing)."""
    resident = sum(p.data.nbytes + p.grad.nbytes for p in model.params())
    resident += sum(a.nbytes for st in opt.state.values() for a in st.values())
    if xp is not None and xp.__name__ == "cupy":
        step()
        held = xp.get_default_memory_pool().total_bytes()
        return {"resident": resident, "step_peak": max(0, held - resident), "total": held}
    from mpipar.nn import cpu

    cpu.clear_pool()  # pooled buffers made before the window would be invisible to tracemalloc
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {"resident": resident, "step_peak": peak, "total": resident + peak}
