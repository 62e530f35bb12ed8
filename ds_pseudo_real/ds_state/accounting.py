"""What a rank holds, counted: bytes by kind (parameters, gradients, fp32 masters, optimizer state) and the
model's distinct parameter elements over all ranks. Reads sizes, never values (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import Dict

import torch

from .layout import basic_optimizer, stepped_tensors, unique_parameters
from .process_groups import expert_data_parallel_group


def _local_numel(param: torch.nn.Parameter) -> int:
    """Elements this rank stores for ``param`` (its ZeRO-3 partition, or all of it)."""
    partition = getattr(param, "ds_tensor", None)
    return partition.numel() if partition is not None else param.numel()


def memory_report(engine) -> Dict[str, int]:
    """Bytes this rank holds: working parameters, gradients, fp32 masters and optimizer state.

    Parameters, masters and optimizer state are read off the tensors; gradients are what the ZeRO stage keeps
    between backward and step (full for stages 0-1, this rank's partition for 2-3) in DeepSpeed's gradient
    accumulation dtype: an expectation, not a reading.
    """
    params = unique_parameters(engine.module.parameters())
    param_bytes = sum(_local_numel(p) * p.element_size() for p in params)
    optimizer = basic_optimizer(engine)
    master_tensors = [t for _, t in stepped_tensors(engine)]
    module_ids = {id(p) for p in params}
    master_bytes = sum(t.numel() * t.element_size() for t in master_tensors if id(t) not in module_ids)
    states = list(optimizer.state.values()) + list(getattr(optimizer, "own_state", {}).values())
    state_bytes = sum(v.numel() * v.element_size() for s in states for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    stage = engine.zero_optimization_stage()
    grad_elements = sum(t.numel() for t in master_tensors) if stage >= 2 else sum(p.numel() for p in params)
    grad_size = torch.empty((), dtype=engine.get_data_types()[1]).element_size()
    return {
        "parameters": param_bytes,
        "gradients": grad_elements * grad_size,
        "fp32_master": master_bytes,
        "optimizer_state": state_bytes,
    }


def total_parameter_numel(model: torch.nn.Module) -> int:
    """The model's distinct parameter elements over every rank (collective; ZeRO-3 partitioned parameters at their
    full size): what each rank holds alike counted once, and the experts of DeepSpeed 0.19.8's MoE layers (marked
    ``allreduce = False``, each rank holding those of its expert-parallel rank) summed over the ranks and divided by
    the ranks that hold the same ones (their expert-data-parallel group)."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    from ..ranks import gather

    dense, experts = 0, {}
    for param in model.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        if is_moe_param(param):
            experts[param.group_name] = experts.get(param.group_name, 0) + numel
        else:
            dense += numel
    if not experts or not dist.is_initialized():
        return dense + sum(experts.values())
    per_rank = gather(experts)
    return dense + sum(sum(held[name] for held in per_rank) // dist.get_world_size(expert_data_parallel_group(name))
                       for name in experts)
