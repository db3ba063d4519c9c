"""One training step (forward, backward, AdamW update) of the same GPT, in mpipar and in PyTorch.

Both sides: one rank, one micro-batch of ``batch`` sequences of ``seq`` tokens, float32, AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only), no gradient clipping. The
architecture is mpipar's ``build_gpt`` with untied embeddings: learned positions, pre-LN blocks
with fused QKV (bias), causal softmax attention, output projection (bias), GELU (tanh) MLP of
width 4d, final LayerNorm, LM head without bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the benchmark shapes of issue 9
CONFIGS = {
    "tiny": dict(vocab_size=64, n_embd=32, n_head=4, n_layer=2, seq=16, batch=4),
    "small": dict(vocab_size=256, n_embd=256, n_head=8, n_layer=4, seq=128, batch=16),
    "large": dict(vocab_size=512, n_embd=512, n_head=8, n_layer=6, seq=256, batch=8),
    # a GPU-sized shape (experiments/gpu_bench.py): ~5.4 TFLOP per step
    "xl": dict(vocab_size=1024, n_embd=1024, n_head=16, n_layer=8, seq=512, batch=16),
}


@dataclass
class Shape:
    name: str
    vocab_size: int
    n_embd: int
    n_head: int
    n_layer: int
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def model_config(self):
        from mpipar.config import ModelConfig

        return ModelConfig(kind="gpt", vocab_size=self.vocab_size, block_size=self.seq,
                           n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head)

    def flops_config(self) -> dict:
        """The config dict mpipar.analysis.flops reads."""
        return {"model": {"kind": "gpt", "vocab_size": self.vocab_size, "n_embd": self.n_embd,
                          "n_layer": self.n_layer, "n_head": self.n_head},
                "train": {"batch_size": self.batch, "seq_len": self.seq}}


def shape(name: str) -> Shape:
    if name not in CONFIGS:
        raise ValueError(f"unknown benchmark config {name!r}: choose from {sorted(CONFIGS)}")
    return Shape(name, **CONFIGS[name])


def batch_ids(sh: Shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, sh.vocab_size, size=(sh.batch, sh.seq))
    y = rng.integers(0, sh.vocab_size, size=(sh.batch, sh.seq))
    return x, y


def mpipar_step(sh: Shape, device="cpu", seed=0, lr=1e-3):
    """(step function returning the loss, model, optimizer) for mpipar on ``device``."""
    from mpipar.backend import Backend
    from mpipar.models import build_model
    from mpipar.nn.optim import AdamW

    backend = Backend(device, "float32")
    model = build_model(sh.model_config(), backend, seed)
    opt = AdamW(model.params(), lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x, y = (backend.xp.asarray(a) for a in batch_ids(sh))

    def step():
        opt.zero_grad()
        h = x
        for u in model.units:
            h = u.forward(h, 0)
        loss = model.loss.forward(h, y, 0, 1.0)
        d = model.loss.backward(0)
        for u in reversed(model.units):
            d = u.backward(d, 0)
        opt.step()
        backend.synchronize()
        return loss

    return step, model, opt
