"""Where an engine keeps what its optimizer steps: the torch optimizer, each parameter's fp32 master and its state.
Finds those tensors for the other modules; what is read or written through them is theirs (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch


def basic_optimizer(engine) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer that holds the state: ZeRO and the bf16 optimizer wrap it as ``.optimizer``."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def is_managed(param: torch.nn.Parameter) -> bool:
    """True when DeepSpeed maps ``param`` onto flat fp32 partitions (ZeRO 1-3, bf16 optimizer): use safe_*."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def master_of(engine, param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor the optimizer steps for an unmanaged ``param``: itself, or the fp32 copy kept by the
    stage-0 mixed-precision optimizers (``fp16_groups``/``fp32_groups`` in parallel lists)."""
    optimizer = engine.optimizer
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if low is None or high is None:
        return param
    for low_group, high_group in zip(low, high):
        for low_param, high_param in zip(low_group, high_group):
            if low_param is param:
                return high_param
    return param


def optimizer_state(engine, tensor: torch.Tensor) -> Dict[str, Any]:
    """The state entry of ``tensor``: granular offload keeps its own groups' states outside ``.state``."""
    optimizer = basic_optimizer(engine)
    return optimizer.state_of(tensor) if hasattr(optimizer, "state_of") else optimizer.state[tensor]


def stepped_tensors(engine):
    """(group index, tensor) for every tensor whose optimizer state exists. ZeRO-3 keeps its flat fp32
    sub-groups outside ``param_groups`` between steps, so they are listed from the ZeRO optimizer; granular
    offload's own groups (outside DeepSpeed's optimizer) follow the param groups."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        groups = getattr(engine.optimizer, "sub_group_to_group_id", {})
        return [(groups.get(i, 0), t) for i, t in enumerate(flats)]
    optimizer = basic_optimizer(engine)
    groups = list(optimizer.param_groups) + list(getattr(optimizer, "own_param_groups", []))
    return [(i, t) for i, g in enumerate(groups) for t in g["params"]]


def own_copy(value: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """A new fp32 tensor on ``device`` (the CPU when None) holding ``value``: one copy, never a view of it."""
    return value.detach().to(device or "cpu", torch.float32, copy=True)


def unique_parameters(params: Iterable[torch.nn.Parameter]):
    """``params`` in order, each once (a parameter tied to another is listed by both)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
