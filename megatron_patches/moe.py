"""M6 expert prototyping for megatron.core's MoE layer: a router that plugs into ``MoESubmodules.router``.

Owns: ``ExpertPrototypingRouter`` (routing math from ``ds_pseudo_real.moe.routing``; the token dispatcher, the
experts and expert parallelism stay Megatron's), the layer spec that uses it, and the TransformerConfig fields it
needs. Written against megatron-core 0.16.1 (TopKRouter.routing(logits, padding_mask) -> (probs, routing_map);
the router's input is the sequence-parallel slice of the tokens when sequence parallelism is on).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from ds_pseudo_real.moe import routing


def check_router_config(config, num_prototypes: int) -> None:
    """The TransformerConfig an expert-prototyping router needs; errors name Megatron's flags."""
    routing.check_prototypes(config.num_moe_experts, num_prototypes)
    if config.moe_router_topk != num_prototypes:
        raise ValueError(
            f"--moe-router-topk must equal --m6-expert-prototypes (every token visits one expert per prototype); "
            f"got topk {config.moe_router_topk} and {num_prototypes} prototypes"
        )
    if config.moe_router_load_balancing_type != "none":
        raise ValueError(
            f"--moe-router-load-balancing-type must be 'none' with expert prototyping (its balance loss is per "
            f"prototype, weighted by --moe-aux-loss-coeff); got {config.moe_router_load_balancing_type!r}"
        )


class ExpertPrototypingRouter(TopKRouter):
    """Top-1 inside each of ``num_prototypes`` groups of experts; the MoE layer sums the k gated outputs.

    Uses ``config.moe_expert_capacity_factor`` / ``moe_token_drop_policy`` for token dropping and
    ``config.moe_aux_loss_coeff`` for the per-prototype balance loss; Megatron's own balancing must be "none".
    With sequence parallelism (required for MoE with TP>1) each tensor-parallel rank holds a slice of the sequence;
    the router gathers the slices' logits and routes the whole sequence, so capacity, dropping and the balance
    loss are those of TP=1, then keeps its own slice.
    """

    def __init__(self, config, pg_collection=None, num_prototypes: int = 1):
        check_router_config(config, num_prototypes)
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_prototypes = num_prototypes

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        local_tokens = logits.shape[0]
        slices = self.tp_group.size() if self.config.sequence_parallel else 1
        if slices > 1:
            # All-gather forward, reduce-scatter backward: each slice's logits get every rank's gradient for them.
            logits = gather_from_sequence_parallel_region(logits, group=self.tp_group)
        probs, routing_map = routing.expert_prototype_routing(logits, self.num_prototypes)
        coeff = self.config.moe_aux_loss_coeff
        if self.training and torch.is_grad_enabled() and coeff:
            balance = routing.load_balancing_loss(logits, routing_map, self.num_prototypes)
            # Every slice holder adds the whole sequence's loss; the reduce-scatter sums their gradients.
            probs = MoEAuxLossAutoScaler.apply(probs, coeff * balance / slices)
        if self.config.moe_expert_capacity_factor is not None:
            capacity = routing.expert_capacity(logits.shape[0], logits.shape[1], self.num_prototypes,
                                               self.config.moe_expert_capacity_factor)
            probs, routing_map = routing.drop_over_capacity(probs, routing_map, capacity,
                                                            self.config.moe_token_drop_policy)
        if slices > 1:
            start = self.tp_group.rank() * local_tokens
            probs, routing_map = probs[start:start + local_tokens], routing_map[start:start + local_tokens]
        return probs, routing_map


def m6_moe_config(num_experts: int, num_prototypes: int, capacity_factor: Optional[float] = None,
                  balance_loss_coeff: float = 0.0, dispatcher: str = "alltoall") -> Dict[str, Any]:
    """The TransformerConfig fields of an M6 expert-prototyping MoE (every layer MoE).

    Linear layers carry no bias, as in the M6 parameter count (2 x hidden x ffn per expert); megatron-core 0.16.1's
    expert MLP also fails with a bias and per-token gates (in-place add on a view in mlp.py).
    """
    routing.check_prototypes(num_experts, num_prototypes)
    return dict(num_moe_experts=num_experts, moe_router_topk=num_prototypes, moe_expert_capacity_factor=capacity_factor,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=balance_loss_coeff,
                moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False, add_bias_linear=False)


def use_prototyping_router(layer_spec: ModuleSpec, num_prototypes: int) -> ModuleSpec:
    """Swap the router of an MoE layer spec (in place) for the expert-prototyping one; returns the spec."""
    layer_spec.submodules.mlp.submodules.router = functools.partial(ExpertPrototypingRouter,
                                                                    num_prototypes=num_prototypes)
    return layer_spec


def m6_layer_spec(num_experts: int, num_prototypes: int) -> ModuleSpec:
    """megatron.core's local (no Transformer Engine) GPT layer spec with an M6 expert-prototyping MoE."""
    return use_prototyping_router(get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False),
                                  num_prototypes)


def use_prototyping_routers(model: torch.nn.Module, num_prototypes: int) -> int:
    """Turn every TopKRouter of a built model into an expert-prototyping one, in place; returns how many.

    For models whose spec the caller does not control (the drop-in ``run``). Only the routing function changes,
    so the router keeps its Parameters (and their sharing in a pseudo model) and its state-dict keys.
    """
    routers = [m for m in model.modules() if type(m) is TopKRouter]
    for router in routers:
        check_router_config(router.config, num_prototypes)
        router.__class__ = ExpertPrototypingRouter
        router.num_prototypes = num_prototypes
    return len(routers)
