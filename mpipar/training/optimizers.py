"""The optimizer of a run: AdamW or SGD as ``train.*`` says, the learning-rate schedule, and one
optimizer per pipeline chunk for the modes whose chunks step on their own (PipeDream)."""

from __future__ import annotations

from ..config import Config
from ..nn.optim import SGD, AdamW, lr_at


def step_lr(cfg: Config, step: int) -> float:
    """The learning rate of 0-based step ``step`` of the run ``cfg`` describes."""
    t = cfg.train
    # a short run (--steps 3 on a config made for 200) keeps a warm-up that fits it
    return lr_at(step, t.lr, min(t.warmup_steps, t.steps - 1), t.steps, t.min_lr)


def make_optimizer(cfg: Config, params):
    t = cfg.train
    if t.optimizer == "adamw":
        return AdamW(params, t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                     weight_decay=t.weight_decay)
    return SGD(params, t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


class ChunkOptimizers:
    """One optimizer per pipeline chunk (asynchronous PipeDream), seen as one for checkpoints."""

    def __init__(self, chunks: dict):
        self.chunks = chunks
        self.BUFFERS = next(iter(chunks.values())).BUFFERS

    @property
    def step_count(self):
        return next(iter(self.chunks.values())).step_count

    def state_dict(self):
        out = {}
        for o in self.chunks.values():
            out.update(o.state_dict())
        return out

    def load_state_dict(self, state):
        for o in self.chunks.values():
            o.load_state_dict({p.name: state[p.name] for p in o.params})
