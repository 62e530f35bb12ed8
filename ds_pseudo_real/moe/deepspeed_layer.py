"""M6 expert prototyping on DeepSpeed's MoE (deepspeed.moe, expert parallelism with ``ep_size``).

Owns: ``ExpertPrototypingGate`` (the routing math of ``ds_pseudo_real.moe.routing`` in the gate interface that
DeepSpeed's MOELayer calls) and ``ExpertPrototypingMoE``, a ``deepspeed.moe.layer.MoE`` using it. Dispatch,
all-to-all and the experts stay DeepSpeed's. Written against DeepSpeed 0.19.8 (sparse-route gate outputs).
"""
from __future__ import annotations

from typing import Optional

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from ds_pseudo_real.moe import routing


class ExpertPrototypingGate(nn.Module):
    """Gate returning DeepSpeed's sparse routes: one route per prototype.

    Returns ``(l_aux, capacity, E, indices [k, T], locations [k, T], gates [k, T], exp_counts [E])`` with
    ``indices`` -1 where the capacity dropped the token. The capacity comes from the local token count: the
    expert all-to-all needs every rank to pass the same number of tokens per step.
    """

    def __init__(self, hidden_size: int, num_experts: int, num_prototypes: int, capacity_factor: float = 1.0,
                 drop_policy: str = "probs"):
        super().__init__()
        routing.check_prototypes(num_experts, num_prototypes)
        self.wg = nn.Linear(hidden_size, num_experts, bias=False).float()
        self.num_experts = num_experts
        self.num_prototypes = num_prototypes
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.ep_group = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None, sparse_routes: bool = True,
                use_tutel: bool = False):
        if used_token is not None or not sparse_routes or use_tutel:
            raise NotImplementedError("ExpertPrototypingGate supports DeepSpeed's sparse routes only "
                                      "(no used_token mask, no Tutel)")
        # fp32 routing whatever dtype the engine cast the gate to (bf16), as DeepSpeed's TopKGate does
        logits = nn.functional.linear(input.float(), self.wg.weight.float())
        tokens, experts = logits.shape
        gates, routed = routing.expert_prototype_routing(logits, self.num_prototypes)
        l_aux = routing.load_balancing_loss(logits, routed, self.num_prototypes)
        capacity = routing.expert_capacity(tokens, experts, self.num_prototypes, self.capacity_factor)
        gates, kept = routing.drop_over_capacity(gates, routed, capacity, self.drop_policy)
        per = experts // self.num_prototypes
        chosen = routed.view(tokens, self.num_prototypes, per).float().argmax(-1)
        chosen = chosen + torch.arange(self.num_prototypes, device=logits.device) * per  # [T, k] global expert ids
        kept_route = kept.gather(1, chosen)
        indices = torch.where(kept_route, chosen, torch.full_like(chosen, -1)).t()
        locations = routing.expert_slots(kept).gather(1, chosen).clamp(min=0).t()
        route_gates = gates.gather(1, chosen).t().float()
        return l_aux, capacity, experts, indices, locations, route_gates, routed.sum(0)


class ExpertPrototypingMoE(MoE):
    """``deepspeed.moe.layer.MoE`` with E experts split into ``num_prototypes`` prototypes (k top-1).

    ``forward(hidden_states)`` returns ``(output, l_aux, exp_counts)`` as DeepSpeed's MoE does; add
    ``coeff * l_aux`` to the loss for load balancing. Build optimizer groups with DeepSpeed's
    ``split_params_into_different_moe_groups_for_optimizer``.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int, num_prototypes: int, ep_size: int = 1,
                 capacity_factor: float = 1.0, drop_policy: str = "probs"):
        super().__init__(hidden_size, expert, num_experts=num_experts, ep_size=ep_size, k=1,
                         capacity_factor=capacity_factor, use_rts=False)
        self.num_prototypes = num_prototypes
        self.deepspeed_moe.gate = ExpertPrototypingGate(hidden_size, num_experts, num_prototypes, capacity_factor,
                                                        drop_policy)
