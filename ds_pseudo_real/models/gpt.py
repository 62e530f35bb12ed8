"""A small byte-level GPT (pre-LayerNorm, causal self-attention) whose blocks live in ``model.layers``.

Plain torch, no knowledge of sharing or DeepSpeed: the plugin finds the layer list by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 8
    d_model: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    bias: bool = True  # of the attention's linear layers
    checkpoint_activations: bool = False  # recompute each layer in the backward (see call_layer)

    def parameter_count(self) -> int:
        """The parameters of ``GPT(self)``, without building it (a model too large to build, or to import what
        building one on the meta device imports, is counted all the same; tested against the built model)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        attention = 4 * d * d + (4 * d if self.bias else 0)
        block = 2 * d + attention + 2 * d + (d * hidden + hidden) + (hidden * d + d)
        return (self.vocab_size + self.seq_len) * d + self.n_layer * block + 2 * d + d * self.vocab_size


def call_layer(layer: nn.Module, x: torch.Tensor, checkpoint: bool):
    """``layer(x)``. With ``checkpoint`` (while autograd records) the layer keeps only its input for the backward
    and runs its forward again there: torch's non-reentrant checkpoint, which computes the same values and gradients
    bit for bit and works for layers that share parameters under every ZeRO stage (a reentrant one, DeepSpeed's
    included, fires a shared parameter's gradient hook once per layer, which ZeRO 2/3 refuse). The random state is
    restored for the recompute. The layer is called as a module, so its forward pre-hooks (granular offload's fetch)
    run for the recompute too."""
    if checkpoint and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    return layer(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2 style: shrink the residual projections by depth so the stream's variance stays bounded.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                nn.init.normal_(param, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for layer in self.layers:
            x = call_layer(layer, x, self.cfg.checkpoint_activations)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
