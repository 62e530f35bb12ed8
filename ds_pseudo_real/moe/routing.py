"""Expert-prototyping routing math (M6-T / M6-10T), as plain functions over tensors.

Owns: splitting E experts into k prototypes, top-1 routing inside each prototype, expert capacity and token
dropping, the per-prototype load-balancing loss, and the dispatch/combine tensors of a capacity-bounded MoE.
Shared by the Megatron router (megatron_patches.moe) and the DeepSpeed gate (ds_pseudo_real.moe.deepspeed_layer);
must not touch either library.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

DROP_POLICIES = ("probs", "position")


def check_prototypes(num_experts: int, num_prototypes: int) -> int:
    """Experts per prototype; raises if ``num_prototypes`` does not divide ``num_experts``."""
    if num_prototypes < 1 or num_experts % num_prototypes != 0:
        raise ValueError(
            f"m6 expert prototypes: got {num_prototypes} prototypes for {num_experts} experts; the number of prototypes "
            f"must divide the number of experts (accepted: {[k for k in range(1, num_experts + 1) if num_experts % k == 0]})"
        )
    return num_experts // num_prototypes


def prototype_scores(logits: torch.Tensor, num_prototypes: int) -> torch.Tensor:
    """Softmax over the experts of each prototype: ``[tokens, E]`` logits -> ``[tokens, k, E/k]`` scores."""
    tokens, experts = logits.shape
    per = check_prototypes(experts, num_prototypes)
    return torch.softmax(logits.float().view(tokens, num_prototypes, per), dim=-1)


def expert_capacity(num_tokens: int, num_experts: int, num_prototypes: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ``capacity_factor`` x its fair share (every token goes to k of the E experts)."""
    return max(1, math.ceil(capacity_factor * num_tokens * num_prototypes / num_experts))


def drop_over_capacity(
    gates: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert: the highest gates (``"probs"``) or the earliest (``"position"``)."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"token drop policy: got {policy!r}, expected one of {DROP_POLICIES}")
    tokens = routing_map.shape[0]
    if policy == "probs":
        key = gates.detach().float()
    else:
        key = -torch.arange(tokens, dtype=torch.float32, device=gates.device).unsqueeze(1).expand_as(gates)
    key = key.masked_fill(~routing_map, float("-inf"))
    chosen = torch.topk(key, k=min(capacity, tokens), dim=0).indices
    keep = torch.zeros_like(routing_map).scatter(0, chosen, True) & routing_map
    return gates * keep, keep


def expert_prototype_routing(
    logits: torch.Tensor,
    num_prototypes: int,
    capacity_factor: Optional[float] = None,
    drop_policy: str = "probs",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route each token to the top-1 expert of each of ``num_prototypes`` prototypes ("k top-1").

    Args: ``logits`` ``[tokens, E]``; prototype p owns experts ``p*E/k .. (p+1)*E/k - 1``.
    Returns ``gates`` ``[tokens, E]`` (the chosen experts' softmax score within their prototype, 0 elsewhere) and
    ``routing_map`` ``[tokens, E]`` bool. A token's output is ``sum_e gates[t, e] * expert_e(x_t)``. With a
    ``capacity_factor`` tokens over an expert's capacity are dropped from that expert (their gate becomes 0).
    """
    tokens, experts = logits.shape
    scores = prototype_scores(logits, num_prototypes)
    chosen = scores.argmax(dim=-1)
    routing_map = F.one_hot(chosen, scores.shape[-1]).bool().view(tokens, experts)
    gates = (scores.view(tokens, experts) * routing_map).to(logits.dtype)
    if capacity_factor is not None:
        capacity = expert_capacity(tokens, experts, num_prototypes, capacity_factor)
        gates, routing_map = drop_over_capacity(gates, routing_map, capacity, drop_policy)
    return gates, routing_map


def load_balancing_loss(logits: torch.Tensor, routing_map: torch.Tensor, num_prototypes: int) -> torch.Tensor:
    """Switch-Transformer balance loss inside each prototype, averaged over prototypes.

    Per prototype: ``n * sum_e f_e * P_e`` with n experts, ``f_e`` the fraction of tokens routed to expert e and
    ``P_e`` its mean score; 1.0 when routing is uniform. ``routing_map`` is taken before token dropping.
    """
    tokens, experts = logits.shape
    scores = prototype_scores(logits, num_prototypes)
    per = scores.shape[-1]
    fraction = routing_map.float().view(tokens, num_prototypes, per).mean(dim=0)
    mean_score = scores.mean(dim=0)
    return (per * (fraction * mean_score).sum(dim=-1)).mean()


def expert_slots(routing_map: torch.Tensor) -> torch.Tensor:
    """``[tokens, E]`` position of each routed token in its expert's buffer (tokens in order; -1 where not routed)."""
    slot = torch.cumsum(routing_map.long(), dim=0) - 1
    return slot.masked_fill(~routing_map, -1)


def dispatch_and_combine(
    gates: torch.Tensor, routing_map: torch.Tensor, capacity: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GShard-style ``[tokens, E, capacity]`` tensors: ``dispatch_mask`` places each kept (token, expert) pair in its
    ``expert_slots`` slot; ``combine_weights`` carries its gate there."""
    slot = expert_slots(routing_map)
    if int(slot.max()) >= capacity:
        raise ValueError(f"more tokens routed to one expert than its capacity {capacity}: drop them first")
    slot_onehot = F.one_hot(slot.clamp(min=0), capacity).to(gates.dtype) * routing_map.unsqueeze(-1)
    combine_weights = gates.unsqueeze(-1) * slot_onehot
    return combine_weights, slot_onehot.bool()


__all__ = [
    "DROP_POLICIES",
    "check_prototypes",
    "prototype_scores",
    "expert_capacity",
    "drop_over_capacity",
    "expert_prototype_routing",
    "load_balancing_loss",
    "expert_slots",
    "dispatch_and_combine",
]
