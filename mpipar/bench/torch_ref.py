"""The same GPT in PyTorch eager (``torch.nn``), the peer mpipar's hand-written path is measured
against. Optional: ``available()`` says whether torch imports; callers skip the column if not.

Attention uses ``F.scaled_dot_product_attention(is_causal=True)``, what a PyTorch user writes
today (on the CPU it picks a fused flash kernel); ``attention="manual"`` gives the textbook
masked-softmax version for comparison.
"""

from __future__ import annotations

import math


def available() -> tuple[bool, str]:
    try:
        import torch
    except Exception as exc:  # ImportError or a broken install
        return False, f"torch not importable ({exc.__class__.__name__}: {exc})"
    return True, torch.__version__


def build(sh, device="cpu", seed=0, attention="sdpa"):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, d, nh):
            super().__init__()
            self.nh = nh
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def attn(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.nh, d // self.nh).permute(2, 0, 3, 1, 4)
            if attention == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                a = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.nh))
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
                o = a.masked_fill(mask, float("-inf")).softmax(-1) @ v
            return self.proj(o.transpose(1, 2).reshape(b, s, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = sh.n_embd
            self.tok = nn.Embedding(sh.vocab_size, d)
            self.pos = nn.Embedding(sh.seq, d)
            self.blocks = nn.ModuleList(Block(d, sh.n_head) for _ in range(sh.n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, sh.vocab_size, bias=False)

        def forward(self, ids):
            h = self.tok(ids) + self.pos.weight[: ids.shape[1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln_f(h))

    torch.manual_seed(seed)
    model = GPT().to(device)
    for p in model.parameters():  # same init scale as mpipar (normal, std 0.02)
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


def torch_step(sh, device="cpu", seed=0, attention="sdpa"):
    """(step function returning the loss, model, optimizer)."""
    import torch
    from torch.nn import functional as F

    from .steps import batch_ids

    model, opt = build(sh, device, seed, attention)
    x, y = (torch.as_tensor(a, device=device) for a in batch_ids(sh))
    cuda = device != "cpu"

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        return loss.item()

    return step, model, opt
