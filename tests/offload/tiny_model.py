"""Small layer-stack language models for the offload tests (layers at ``model.layers``): dense, and with an M6
expert-prototyping MoE (deepspeed.moe) in every layer."""
import torch
from torch import nn

from ds_pseudo_real.moe.deepspeed_layer import ExpertPrototypingMoE


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MoEBlock(nn.Module):
    """4 experts in 2 prototypes over ``ep_size`` ranks; returns the output and the balance loss."""

    def __init__(self, d, ep_size):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        expert = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.moe = ExpertPrototypingMoE(d, expert, num_experts=4, num_prototypes=2, ep_size=ep_size,
                                        capacity_factor=2.0)
        for p in self.moe.deepspeed_moe.experts.parameters():
            nn.init.normal_(p, std=0.1)  # DeepSpeed deep-copies one expert: give each its own weights

    def forward(self, x):
        out, l_aux, _ = self.moe(self.norm(x))
        return x + out, l_aux


class TinyLM(nn.Module):
    def __init__(self, d=32, num_layers=4, vocab=64, ep_size=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        block = Block if ep_size is None else (lambda d: MoEBlock(d, ep_size))
        self.layers = nn.ModuleList([block(d) for _ in range(num_layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.embed(x)
        balance = 0.0
        for layer in self.layers:
            h = layer(h)
            if isinstance(h, tuple):
                h, l_aux = h
                balance = balance + l_aux
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) + 0.01 * balance


def batch(step, rank, size=4, length=8, vocab=64):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, vocab, (size, length), generator=g)
    return x, x.roll(-1, 1)


def offload_config(stage, level, dtype="fp32"):
    """The DeepSpeed config these tests train TinyLM with: AdamW, no gradient clipping (the offload optimizer's own
    groups then step bit for bit as DeepSpeed's do) and every one of its 4 layers at ``level``."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "granular_offload": {"levels": {str(i): level for i in range(4)}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg
