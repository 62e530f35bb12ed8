"""The M6 expert-prototyping MoE as a trainable GPT on DeepSpeed's MoE, experts spread over ``ep_size`` ranks.

Owns: the model the main job builds from an ``m6`` section (``ds_pseudo_real.moe.architecture.M6Architecture``):
attention without biases, an ``ExpertPrototypingMoE`` MLP in every block, learned positions, the output head tied to
the word embedding, and the optimizer groups DeepSpeed's MoE needs. The routing math and the gate are ``moe``'s.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..moe.architecture import M6Architecture
from ..moe.deepspeed_layer import ExpertPrototypingMoE
from .gpt import CausalSelfAttention, GPTConfig, call_layer


def _expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    key = hashlib.sha256(f"m6/{seed}/{layer}/{expert}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)


class M6Block(nn.Module):
    def __init__(self, arch: M6Architecture, ep_size: int, capacity_factor: float):
        super().__init__()
        h = arch.hidden_size
        self.ln1 = nn.LayerNorm(h)
        self.attn = CausalSelfAttention(GPTConfig(d_model=h, n_head=arch.num_heads, bias=False))
        self.ln2 = nn.LayerNorm(h)
        expert = nn.Sequential(nn.Linear(h, arch.expert_ffn_size, bias=False), nn.GELU(),
                               nn.Linear(arch.expert_ffn_size, h, bias=False))
        self.moe = ExpertPrototypingMoE(h, expert, num_experts=arch.num_experts, num_prototypes=arch.num_prototypes,
                                        ep_size=ep_size, capacity_factor=capacity_factor)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The block's output and its load-balancing loss (returned, not kept on the module: a recompute in the
        backward would otherwise leave a tensor holding its graph there until the next forward)."""
        x = x + self.attn(self.ln1(x))
        out, balance_loss, _ = self.moe(self.ln2(x))
        return x + out, balance_loss


class M6GPT(nn.Module):
    """``forward(idx, targets)`` returns the language-model loss plus ``balance_coeff`` x the mean load-balancing loss
    of the layers while training (evaluation reports the language-model loss alone); without targets, the logits.

    Every expert is initialized from its own generator keyed by (seed, layer, global expert index), so the model is
    the same whatever the expert-parallel size. Expert-parallel groups are DeepSpeed 0.19.8's: consecutive ranks.
    """

    def __init__(self, arch: M6Architecture, ep_size: int = 1, capacity_factor: float = 1.25,
                 balance_coeff: float = 0.01, seed: int = 0, checkpoint_activations: bool = False):
        super().__init__()
        self.arch, self.ep_size, self.balance_coeff = arch, ep_size, balance_coeff
        self.checkpoint_activations = checkpoint_activations
        self.tok_emb = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.pos_emb = nn.Embedding(arch.seq_length, arch.hidden_size)
        self.layers = nn.ModuleList(M6Block(arch, ep_size, capacity_factor) for _ in range(arch.num_layers))
        self.ln_f = nn.LayerNorm(arch.hidden_size)
        if not self.tok_emb.weight.is_meta:  # built on the meta device to count and plan: no values to set
            self._initialize(seed)

    @torch.no_grad()
    def _initialize(self, seed: int) -> None:
        depth_scale = (2 * self.arch.num_layers) ** -0.5
        for name, param in self.named_parameters():
            if is_expert(param):
                continue
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, 0.02 * (depth_scale if name.endswith("attn.proj.weight") else 1.0))
        ep_rank = dist.get_rank() % self.ep_size if dist.is_initialized() else 0
        for index, layer in enumerate(self.layers):
            local = layer.moe.deepspeed_moe.experts.deepspeed_experts
            for i, expert in enumerate(local):
                generator = _expert_generator(seed, index, ep_rank * len(local) + i)
                first, second = expert[0].weight, expert[2].weight
                first.copy_(torch.randn(first.shape, generator=generator) * 0.02)
                second.copy_(torch.randn(second.shape, generator=generator) * 0.02 * depth_scale)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        balance = []
        for layer in self.layers:
            x, balance_loss = call_layer(layer, x, self.checkpoint_activations)
            balance.append(balance_loss)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if not self.training or not self.balance_coeff:
            return loss
        return loss + self.balance_coeff * torch.stack(balance).mean()


def is_expert(param: nn.Parameter) -> bool:
    """DeepSpeed's MoE marks expert parameters ``allreduce = False`` (reduced over the expert-data-parallel group)."""
    return getattr(param, "allreduce", True) is False


def moe_param_groups(model: nn.Module) -> List[Dict]:
    """Optimizer groups with the experts apart, as DeepSpeed's MoE requires."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    return split_params_into_different_moe_groups_for_optimizer([{"params": params, "name": "dense"}])
