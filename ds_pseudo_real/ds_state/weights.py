"""The full fp32 weights of an engine's parameters, read from and written into the masters its optimizer steps.
Leaves the working parameters as they are; moments are moments.py's, read through it (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

from .layout import basic_optimizer, is_managed, master_of, own_copy
from .moments import full_moments, relink_optimizer_state
from .zero3 import by_swapped_sub_group, resident_sub_group, set_zero3_partition


def full_fp32_param(engine, param: torch.nn.Parameter, device: Optional[torch.device] = None) -> torch.Tensor:
    """The full fp32 value of ``param`` on ``device`` (the CPU when None). A collective under ZeRO-3: call on every
    rank, same order."""
    own_master = getattr(basic_optimizer(engine), "fp32_master", None)
    value = own_master(param) if own_master is not None else None
    if value is None:
        value = safe_get_full_fp32_param(param) if is_managed(param) else master_of(engine, param)
    return own_copy(value, device)


def set_full_fp32_param(engine, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write the full fp32 ``value`` of ``param`` into the fp32 master its optimizer steps (this rank's part of it
    under ZeRO 1-3, granular offload's host master for its own groups); the working parameter is left as it is."""
    own_master = getattr(basic_optimizer(engine), "fp32_master", None)
    master = own_master(param) if own_master is not None else None
    if master is None and hasattr(param, "ds_id"):
        set_zero3_partition(engine, param, value, None)
        return
    if master is None and is_managed(param):
        safe_set_full_fp32_param(param, value)
        return
    if master is None:
        master = master_of(engine, param)
    with torch.no_grad():
        master.copy_(value)


def gather_full_state(engine, with_moments: bool, device: Optional[torch.device] = None
                      ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """Full fp32 weights (and moments) of every unique parameter, by ``named_parameters`` name, on ``device`` (the
    CPU when None); a swapped ZeRO-3 sub-group at a time, each read once."""
    weights, moments = {}, {}
    if with_moments:
        relink_optimizer_state(engine)
    for index, run in by_swapped_sub_group(engine, engine.module.named_parameters()):
        with resident_sub_group(engine, index, write=False):
            for name, param in run:
                weights[name] = full_fp32_param(engine, param, device)
                if with_moments:
                    value = full_moments(engine, param, name, device)
                    if value is not None:
                        moments[name] = value
    return weights, moments


def set_full_fp32_params(engine, values: Mapping[str, torch.Tensor]) -> None:
    """:func:`set_full_fp32_param` for every parameter, from ``values`` by ``named_parameters`` name (each read once,
    in turn), a swapped ZeRO-3 sub-group at a time."""
    for index, run in by_swapped_sub_group(engine, engine.module.named_parameters()):
        with resident_sub_group(engine, index, write=True):
            for name, param in run:
                set_full_fp32_param(engine, param, values[name])
