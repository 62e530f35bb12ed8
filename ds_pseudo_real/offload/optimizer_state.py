"""Where the GranularOffloadOptimizer (``optimizer``) keeps each param's state, and its checkpoints.

Owns: placing loaded or seeded moments where the plan steps them (device tensors for torch's fused CUDA Adam, the
group's flat host buffers for DeepSpeed's CPU Adam kernel), the own groups' part of ``state_dict()`` and loading a
state dict saved by any plan with the same host_params groups. Must not step (``optimizer``, ``host_adam``) nor
plan (``planner``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from ds_pseudo_real.offload.planner import PlacementLevel

# kept from the current plan when a checkpoint is loaded: ours, and DeepSpeed's MoE keys (checkpoints written
# before expert groups existed hold the plan's group name under "name")
_GROUP_KEYS = ("placement", "level", "moe", "name")
OWN_GROUPS_KEY = "granular_offload_own_groups"  # the own groups' states in ``state_dict()``


def steps_on_device(p: torch.Tensor, level: str) -> bool:
    """True when torch's fused CUDA Adam steps ``p``; else DeepSpeed's CPU Adam kernel does, on the host."""
    return level == PlacementLevel.DEVICE.value and p.is_cuda


def place_state(host, state: Dict[str, Any], p: torch.Tensor, level: str) -> None:
    """Put loaded or seeded moments where this plan steps them: the CPU kernel takes host tensors (its group's
    flat buffers in ``host``, the :class:`~ds_pseudo_real.offload.host_adam.HostAdam`, pinned on CUDA) and an int
    step; torch's fused CUDA Adam takes device tensors and a float32 step tensor there."""
    on_cuda = steps_on_device(p, level)
    for key in ("exp_avg", "exp_avg_sq"):
        if on_cuda:
            state[key] = state[key].to(p.device)
        else:
            buffer = host.buffer(p, key)  # the group's flat host buffer, where the CPU kernel steps it
            if state[key].data_ptr() != buffer.data_ptr():
                buffer.copy_(state[key])
                state[key] = buffer
    step = state["step"]
    if on_cuda and not torch.is_tensor(step):
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
    elif on_cuda:
        state["step"] = step.to(device=p.device, dtype=torch.float32)
    elif torch.is_tensor(step):
        state["step"] = int(step.item())


def own_groups_state(optimizer) -> List[Dict[str, Any]]:
    """What ``state_dict()`` holds under :data:`OWN_GROUPS_KEY`: each own group's states and (bf16) fp32 masters,
    in order, with its params' sizes and names."""
    return [{"placement": g["placement"], "numels": [p.numel() for p in g["params"]],
             "names": g.get("param_names"),
             "states": [optimizer.own_state.get(p, {}) for p in g["params"]],
             "masters": [None if optimizer.host.stale(p) else optimizer.host.masters.get(p) for p in g["params"]]}
            for g in optimizer.own_param_groups]


def load_state_dict(optimizer, state_dict: Dict[str, Any], load_param_groups: Callable[[Dict[str, Any]], None]):
    """See :meth:`~ds_pseudo_real.offload.optimizer.GranularOffloadOptimizer.load_state_dict`;
    ``load_param_groups`` is torch's ``Optimizer.load_state_dict`` of ``optimizer``."""
    state_dict = dict(state_dict)
    own = state_dict.pop(OWN_GROUPS_KEY, [])
    host_states = _take_host_states(optimizer.param_groups, state_dict)
    layout = [(g["placement"], [p.numel() for p in g["params"]]) for g in optimizer.own_param_groups]
    if [(g["placement"], g["numels"]) for g in own] != layout:
        raise ValueError(f"optimizer checkpoint: its granular offload host_params groups "
                         f"{[g['placement'] for g in own]} (outside DeepSpeed's optimizer, ZeRO >= 1 or bf16) "
                         f"differ from this plan's {[name for name, _ in layout]}; load it with the plan it was "
                         f"saved with, or load the module weights only")
    placement = [{k: g[k] for k in _GROUP_KEYS if k in g} for g in optimizer.param_groups]
    load_param_groups(state_dict)
    for group, keep in zip(optimizer.param_groups, placement):
        for key in _GROUP_KEYS:
            group.pop(key, None)
        group.update(keep)
        for p in group["params"]:
            if p in host_states:
                optimizer.state[p] = host_states.pop(p)
            if optimizer.state.get(p):
                place_state(optimizer.host, optimizer.state[p], p, group["level"])
    optimizer.refresh_host_masters()
    for group, saved in zip(optimizer.own_param_groups, own):
        for p, state, master in zip(group["params"], saved["states"], saved["masters"]):
            if state:
                optimizer.own_state[p] = dict(state)
                place_state(optimizer.host, optimizer.own_state[p], p, group["level"])
            if master is not None:
                optimizer.host.set_master(p, group["level"], master)
    optimizer.own_gradients.drop()
    states = list(optimizer.state.values()) + list(optimizer.own_state.values())
    steps = [st["step"] for st in states if isinstance(st.get("step"), int)]
    optimizer.host.replay_kernel_steps(max(steps, default=0), optimizer.param_groups[0])


def _take_host_states(param_groups: List[Dict[str, Any]], state_dict: Dict[str, Any]):
    """Take out of ``state_dict`` (its ``state`` replaced by a copy) the saved states of the params of
    ``param_groups`` stepped on the host, by param (torch 2.x's layout: states keyed by the params' positions in
    the saved ``param_groups``), each a new dict of the saved tensors as they are."""
    state = dict(state_dict["state"])
    state_dict["state"] = state
    taken = {}
    for group, saved in zip(param_groups, state_dict["param_groups"]):
        for p, saved_id in zip(group["params"], saved["params"]):
            if saved_id in state and not steps_on_device(p, group["level"]):
                taken[p] = dict(state.pop(saved_id))
    return taken
