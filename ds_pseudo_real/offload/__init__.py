"""Granular CPU offloading: a per-layer placement planner (``planner``), its config section (``config``), the
``plan`` command (``cli``), the ZeRO-compatible optimizer wrapper (``optimizer``) and host-resident parameters
(``params``). ``build_offload_optimizer`` composes them for ``ds_pseudo_real.initialize``; nothing else here
touches the engine."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torch import nn

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.offload.config import SECTION, explicit_levels, parse_granular_offload, training_setup
from ds_pseudo_real.offload.optimizer import GranularOffloadOptimizer
from ds_pseudo_real.offload.planner import (
    OTHER, GroupSize, OffloadPlan, PlacementLevel, PlanError, describe_plan, place, plan_placement,
)
from ds_pseudo_real.sharing import get_layer_list

ADAM_TYPES = {"adam": None, "adamw": True}  # DeepSpeed: "Adam" takes adam_w_mode (default True), "AdamW" forces it
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def model_groups(model: nn.Module, layer_path: str) -> Tuple[List[GroupSize], List[List[nn.Parameter]]]:
    """One group per layer that owns parameters not seen in an earlier layer, plus ``other`` for the rest.

    Parameters shared between layers (a pseudo model) belong to the first layer using them, counted once;
    ``uses`` says how many layers run with them. Parameters that do not require grad are left out.
    """
    layers = get_layer_list(model, layer_path)
    uses: Dict[int, int] = {}
    for layer in layers:
        for p in set(layer.parameters()):
            uses[id(p)] = uses.get(id(p), 0) + 1
    seen, sizes, params = set(), [], []
    for i, layer in enumerate(layers):
        own = [p for p in layer.parameters() if id(p) not in seen and p.requires_grad]
        seen.update(id(p) for p in layer.parameters())
        if own:
            sizes.append(GroupSize(f"layer{i}", sum(p.numel() for p in own), i, max(uses[id(p)] for p in own)))
            params.append(own)
    rest = [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    if rest:
        sizes.append(GroupSize(OTHER, sum(p.numel() for p in rest)))
        params.append(rest)
    return sizes, params


def adam_arguments(ds_config: Mapping[str, Any]) -> Dict[str, Any]:
    """GranularOffloadOptimizer keyword arguments from DeepSpeed's ``optimizer`` section (Adam or AdamW)."""
    section = ds_config.get("optimizer")
    kind = str((section or {}).get("type", "")).lower()
    if kind not in ADAM_TYPES:
        raise ConfigError(f"invalid config:\n  optimizer.type: got {(section or {}).get('type')!r}; {SECTION} "
                          f"steps Adam-family optimizers only, accepted: 'Adam', 'AdamW'")
    params = dict(section.get("params") or {})
    adamw_mode = params.pop("adam_w_mode", True) if ADAM_TYPES[kind] is None else True
    unknown = sorted(set(params) - set(ADAM_PARAMS))
    if unknown:
        raise ConfigError(f"invalid config:\n  optimizer.params: got keys {unknown}; with {SECTION} accepted: "
                          f"{list(ADAM_PARAMS)}" + (" and adam_w_mode" if ADAM_TYPES[kind] is None else ""))
    return {**params, "adamw_mode": bool(adamw_mode)}


def build_offload_optimizer(model: nn.Module, ds_config: Mapping[str, Any], layer_path: str, world_size: int
                            ) -> Tuple[Optional[GranularOffloadOptimizer], Dict[str, Any], Optional[OffloadPlan]]:
    """Plan placement for ``model`` and build the client optimizer for ``deepspeed.initialize``.

    Args:
        model: the model as it will be given to ``deepspeed.initialize`` (pseudo or real; shared Parameters are
            planned and stepped once).
        ds_config: the DeepSpeed config as a dict; read, never modified.
        layer_path: dotted path of the model's layer list (``"layers"``, ``"transformer.h"``).
        world_size: data-parallel ranks ZeRO partitions over (the planner's D).

    Returns ``(optimizer, patched_config, plan)``. Without an enabled ``"granular_offload"`` section:
    ``(None, ds_config, None)``, nothing changed. With it: the optimizer built from ``ds_config["optimizer"]``
    (Adam/AdamW) over one param group per layer plus ``other``, at the plan's levels; a deep copy of the config
    without ``"optimizer"`` and with ``zero_allow_untested_optimizer: true`` and ``zero_force_ds_cpu_optimizer:
    false``; and the :class:`OffloadPlan` (``describe_offload_plan(plan)`` renders it for logs).

    Call it again on the real model at the delink: a new plan and a new optimizer, nothing reused. Layers at
    ``host_params`` get hooks on their modules (``optimizer.host_params.remove()`` takes them off). Raises
    :class:`ConfigError` for a bad section or optimizer, :class:`PlanError` when nothing fits the budget.
    """
    section = parse_granular_offload(ds_config)
    if section is None:
        return None, ds_config, None
    sizes, params = model_groups(model, layer_path)
    setup = training_setup(ds_config, section, world_size, len(get_layer_list(model, layer_path)))
    if section.levels is not None:
        plan = place(sizes, explicit_levels(section, sizes, len(get_layer_list(model, layer_path))), setup)
    else:
        plan = plan_placement(sizes, setup, section.device_memory, PlacementLevel(section.max_level))
    groups = [{"params": ps, "name": size.name, "level": plan.level_of(size.name).value}
              for size, ps in zip(sizes, params)]
    host_params = None
    if any(g["level"] == PlacementLevel.HOST_PARAMS.value for g in groups):
        from ds_pseudo_real.offload.params import HostParamStore
        host_params = HostParamStore(model, layer_path, [g["params"] for g in groups
                                                          if g["level"] == PlacementLevel.HOST_PARAMS.value],
                                     prefetch=section.prefetch, pin_memory=section.pin_memory)
    optimizer = GranularOffloadOptimizer(groups, pin_memory=section.pin_memory, host_params=host_params,
                                         **adam_arguments(ds_config))
    patched = copy.deepcopy(dict(ds_config))
    patched.pop("optimizer")
    patched["zero_allow_untested_optimizer"] = True  # a client optimizer under ZeRO
    patched["zero_force_ds_cpu_optimizer"] = False  # host groups already run DeepSpeed's CPU Adam kernel
    return optimizer, patched, plan


def describe_offload_plan(plan: Optional[OffloadPlan]) -> str:
    """The plan as a table for logs (``"granular offload: off"`` for None)."""
    return "granular offload: off" if plan is None else describe_plan(plan)


__all__ = ["build_offload_optimizer", "describe_offload_plan", "model_groups", "adam_arguments",
           "GranularOffloadOptimizer", "OffloadPlan", "PlacementLevel", "PlanError", "plan_placement"]
