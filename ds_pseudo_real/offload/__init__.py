"""Granular CPU offloading: a per-layer placement planner (``planner``), its config section (``config``), the
ZeRO-compatible optimizer wrapper (``optimizer``) and host-resident parameters (``params``); the ``plan`` command
that prints a plan is ``ds_pseudo_real.plan_command``. ``offload_optimizer`` composes them for
``ds_pseudo_real.initialize`` (``build_offload_optimizer`` from a DeepSpeed config dict); ``attach_to_engine`` is the
one step taken on the engine built with them (through ``ds_pseudo_real.ds_state``)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
from torch import nn

from ds_pseudo_real import ds_state
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.device import rank_device
from ds_pseudo_real.offload.config import (
    SECTION, GranularOffloadConfig, parse_granular_offload, planned_placement, training_setup,
)
from ds_pseudo_real.offload.layers import rank_layers
from ds_pseudo_real.offload.optimizer import GranularOffloadOptimizer
from ds_pseudo_real.offload.planner import (
    EXPERTS, OTHER, GroupSize, OffloadPlan, PlacementLevel, PlanError, describe_plan, plan_placement,
)
from ds_pseudo_real.training_facts import TrainingFacts

ADAM_TYPES = {"adam": None, "adamw": True}  # DeepSpeed: "Adam" takes adam_w_mode (default True), "AdamW" forces it
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def _numel(params: List[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _expert_data_parallel_sizes(model: nn.Module, world_size: int) -> Dict[str, int]:
    """DeepSpeed expert group name -> ranks ZeRO partitions that group's experts over (world / ep_size)."""
    sizes = {}
    for module in model.modules():
        if isinstance(module, MoE):
            if world_size % module.ep_size:
                raise PlanError(f"MoE ep_size: got {module.ep_size} for {module.expert_group_name!r}; it must divide "
                                f"the world size ({world_size})")
            sizes[module.expert_group_name] = world_size // module.ep_size
    return sizes


def model_groups(model: nn.Module, layer_path: str, world_size: int = 1
                 ) -> Tuple[List[GroupSize], List[List[nn.Parameter]]]:
    """One group per layer that owns parameters not seen in an earlier layer, then one ``layer<i>.experts`` per
    layer owning DeepSpeed MoE expert parameters (``allreduce=False``), then ``other`` for the rest: of the layers
    this rank holds (:func:`~ds_pseudo_real.offload.layers.rank_layers`: a pipeline stage's own, numbered as in the
    whole model), at the size they have here (a tensor-parallel slice's).

    Parameters shared between layers (a pseudo model) belong to the first layer using them, counted once;
    ``uses`` says how many layers run with them. Parameters that do not require grad are left out. An expert
    group's ``dp_size`` is its expert-data-parallel size over ``world_size`` ranks. Raises :class:`PlanError` for
    expert parameters outside the layer list or of two expert groups in one layer (DeepSpeed reduces each
    optimizer group over one expert-data-parallel group).
    """
    layers, _ = rank_layers(model, layer_path)
    expert_dp = _expert_data_parallel_sizes(model, world_size)
    uses: Dict[int, int] = {}
    for _, layer in layers:
        for p in set(layer.parameters()):
            uses[id(p)] = uses.get(id(p), 0) + 1
    seen, dense, experts = set(), [], []
    for i, layer in layers:
        own = [p for p in layer.parameters() if id(p) not in seen and p.requires_grad]
        seen.update(id(p) for p in layer.parameters())
        plain = [p for p in own if not is_moe_param(p)]
        expert = [p for p in own if is_moe_param(p)]
        if plain:
            dense.append((GroupSize(f"layer{i}", _numel(plain), i, max(uses[id(p)] for p in plain)), plain))
        if expert:
            names = sorted({p.group_name for p in expert})
            if len(names) > 1 or names[0] not in expert_dp:
                raise PlanError(f"granular_offload: layer {i} has expert parameters of DeepSpeed expert groups "
                                f"{names}; accepted: one expert group per layer, from a deepspeed.moe.layer.MoE "
                                f"(known: {sorted(expert_dp)})")
            experts.append((GroupSize(f"layer{i}{EXPERTS}", _numel(expert), i, max(uses[id(p)] for p in expert),
                                      expert_dp[names[0]]), expert))
    rest = [p for p in model.parameters() if id(p) not in seen and p.requires_grad]
    if any(is_moe_param(p) for p in rest):
        raise PlanError(f"granular_offload: MoE expert parameters outside the layer list {layer_path!r} are not "
                        f"placeable; accepted: experts inside the layers (planned as 'layer<i>{EXPERTS}')")
    groups = dense + experts + ([(GroupSize(OTHER, _numel(rest)), rest)] if rest else [])
    return [size for size, _ in groups], [ps for _, ps in groups]


def param_group(size: GroupSize, params: List[nn.Parameter], level: PlacementLevel) -> Dict[str, Any]:
    """One optimizer param group: our placement (``placement``, ``level``) and, for experts, DeepSpeed's MoE keys
    (``moe``, and ``name`` = the expert group, which ZeRO 1/2 and the bf16 optimizer read to pick the
    expert-data-parallel group: DeepSpeed 0.19.8 ``_configure_moe_settings``)."""
    group = {"params": params, "placement": size.name, "level": level.value}
    if size.is_experts:
        group.update(moe=True, name=params[0].group_name)
    return group


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


def _plan(model: nn.Module, section: GranularOffloadConfig, training: TrainingFacts, layer_path: str
          ) -> Tuple[List[GroupSize], List[List[nn.Parameter]], OffloadPlan]:
    sizes, params = model_groups(model, layer_path, training.data_parallel_size)
    layers, num_layers = rank_layers(model, layer_path)
    plan = planned_placement(section, sizes, training_setup(section, training, len(layers)), num_layers)
    _refuse_own_steps_of_tied_across_stages(model, sizes, params, plan)
    return sizes, params, plan


def _refuse_own_steps_of_tied_across_stages(model: nn.Module, sizes: List[GroupSize],
                                            params: List[List[nn.Parameter]], plan: OffloadPlan) -> None:
    """A pipeline's tied module held by several stages (a pseudo stage's sharing group over stages, tied embeddings)
    cannot be at host_params where the offload steps that level itself: the pipeline engine all-reduces tied
    gradients between the stages on ``.grad`` before the step (DeepSpeed 0.19.8 ``_exec_reduce_tied_grads``), which
    such a group has already moved to the host, so each stage would step its copy with its own gradient only.
    Collective over the pipeline's ranks (each plans its own stage): every stage refuses when one does."""
    if not plan.setup.host_params_outside_deepspeed or not ds_state.is_pipeline_module(model):
        return
    tied = {id(p) for p in ds_state.tied_across_stages(model)}
    refused = [size.name for size, ps in zip(sizes, params)
               if plan.level_of(size.name) is PlacementLevel.HOST_PARAMS and any(id(p) in tied for p in ps)]
    anywhere = torch.tensor([len(refused)], device=rank_device())  # NCCL takes device tensors only
    if dist.is_initialized():
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)  # a stage that would go on alone waits for the others
    if anywhere.item():
        raise ConfigError(f"invalid config:\n  {SECTION}.levels: got 'host_params' for "
                          f"{refused or 'a group of another stage'}, a module that other pipeline stages hold too (a "
                          f"tied module: a sharing group over stages, tied embeddings); under ZeRO >= 1 or bf16 the "
                          f"offload steps host_params outside DeepSpeed's optimizer, past the pipeline's all-reduce of "
                          f"tied gradients between the stages, and the stages' copies would drift apart; accepted for "
                          f"it: 'device' or 'host_optimizer', or pseudo_to_real.groups a multiple of the number of "
                          f"stages (each set inside one stage)")


def host_params_placement(model: nn.Module, section: GranularOffloadConfig, training: TrainingFacts,
                          layer_path: str) -> Tuple[Set[int], bool]:
    """The ids of the parameters of ``model`` (a meta skeleton will do) that :func:`offload_optimizer` will plan at
    ``host_params``, and whether it pins them: what a model builder needs to give those layers their host storage
    directly (``offload.params.host_param_views``)."""
    sizes, params, plan = _plan(model, section, training, layer_path)
    ids = {id(p) for size, ps in zip(sizes, params) if plan.level_of(size.name) is PlacementLevel.HOST_PARAMS
           for p in ps}
    return ids, section.pin_memory


def build_offload_optimizer(model: nn.Module, ds_config: Mapping[str, Any], layer_path: str, world_size: int
                            ) -> Tuple[Optional[GranularOffloadOptimizer], Dict[str, Any], Optional[OffloadPlan]]:
    """Plan placement for ``model`` and build the client optimizer for ``deepspeed.initialize``, from a DeepSpeed
    config dict (for a script that calls ``deepspeed.initialize`` itself; ``ds_pseudo_real.initialize`` does this).

    Args:
        model: the model as it will be given to ``deepspeed.initialize`` (pseudo or real; shared Parameters are
            planned and stepped once).
        ds_config: the DeepSpeed config as a dict; read, never modified.
        layer_path: dotted path of the model's layer list (``"layers"``, ``"transformer.h"``).
        world_size: data-parallel ranks ZeRO partitions over (the planner's D).

    Returns ``(optimizer, patched_config, plan)``: without an enabled ``"granular_offload"`` section
    ``(None, ds_config, None)``, nothing changed; with it, what :func:`offload_optimizer` returns.
    """
    section = parse_granular_offload(ds_config)
    if section is None:
        return None, ds_config, None
    return offload_optimizer(model, section, TrainingFacts.from_deepspeed(ds_config, world_size), ds_config,
                             layer_path)


def offload_optimizer(model: nn.Module, section: GranularOffloadConfig, training: TrainingFacts,
                      ds_config: Mapping[str, Any], layer_path: str
                      ) -> Tuple[GranularOffloadOptimizer, Dict[str, Any], OffloadPlan]:
    """Plan placement for ``model`` as ``section`` asks, on the run ``training`` describes, and build the client
    optimizer that replaces DeepSpeed's ``optimizer`` section of ``ds_config`` (read, never modified).

    Returns the optimizer, built from ``ds_config["optimizer"]`` (Adam/AdamW) over one param group per layer, one
    per layer's MoE experts (with DeepSpeed's ``moe``/``name`` keys) and ``other``, at the plan's levels; a deep
    copy of ``ds_config`` without ``"optimizer"`` and with ``zero_allow_untested_optimizer: true`` and
    ``zero_force_ds_cpu_optimizer: false``, for ``deepspeed.initialize``; and the :class:`OffloadPlan`
    (``describe_offload_plan(plan)`` renders it for logs).

    Call it again on the real model at the delink: a new plan and a new optimizer, nothing reused. Layers at
    ``host_params`` get hooks on their modules and, under ZeRO >= 1 or bf16, gradient-streaming hooks on their
    parameters, which stay outside DeepSpeed's optimizer (``optimizer.remove_hooks()`` takes them all off), and
    DeepSpeed's model broadcast at initialize sends host tensors through the device under NCCL
    (``ds_state.route_host_broadcasts``). Raises
    :class:`ConfigError` for a bad section or optimizer, :class:`PlanError` when nothing fits the budget or a
    level is not accepted (``host_params`` for ``other``; for every layer's experts under ZeRO >= 1 or bf16).
    """
    ds_state.check_versions("granular_offload")
    adam = adam_arguments(ds_config)  # a bad optimizer section refused before any host memory is taken
    sizes, params, plan = _plan(model, section, training, layer_path)
    groups = [param_group(size, ps, plan.level_of(size.name)) for size, ps in zip(sizes, params)]
    fetched = [g for g in groups if g["level"] == PlacementLevel.HOST_PARAMS.value]
    device = rank_device()
    host_params = None
    if fetched:
        from ds_pseudo_real.offload.params import HostParamStore

        ds_state.route_host_broadcasts()  # the engine broadcasts the model, host tensors included, at initialize
        host_params = HostParamStore(model, layer_path, [g["params"] for g in fetched],
                                     prefetch=section.prefetch, pin_memory=section.pin_memory, device=device)
    own = fetched if plan.setup.host_params_outside_deepspeed else []
    names = {id(p): name for name, p in model.named_parameters()}
    for group in own:  # named in checkpoints, where DeepSpeed's consolidation does not see them
        group["param_names"] = [names[id(p)] for p in group["params"]]
    kept = [g for g in groups if all(g is not o for o in own)]
    if not kept:
        raise PlanError(f"{SECTION}: every parameter group is at 'host_params', which under ZeRO >= 1 or bf16 stays "
                        f"outside DeepSpeed's optimizer, and DeepSpeed needs one group at least; accepted: put one "
                        f"group (e.g. 'other') at 'device' or 'host_optimizer'")
    clip_grad = float(ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
    optimizer = GranularOffloadOptimizer(kept, pin_memory=section.pin_memory, host_params=host_params,
                                         own_groups=own, stream_gradients=plan.setup.streams_gradients,
                                         clip_grad=clip_grad, device=device, host_step=section.host_step,
                                         delayed_from_step=section.delayed_from_step, **adam)
    if section.host_step != "sequential" and not (own and plan.setup.streams_gradients):
        from ds_pseudo_real.ranks import log_rank0

        log_rank0(f"{SECTION}.host_step {section.host_step!r}: no layer here is stepped by the offload itself "
                  f"(host_params under ZeRO 1/2), so every host step runs after the backward, as 'sequential'")
    patched = copy.deepcopy(dict(ds_config))
    patched.pop("optimizer")
    patched["zero_allow_untested_optimizer"] = True  # a client optimizer under ZeRO
    patched["zero_force_ds_cpu_optimizer"] = False  # host groups already run DeepSpeed's CPU Adam kernel
    return optimizer, patched, plan


def attach_to_engine(engine) -> None:
    """After ``deepspeed.initialize`` with a :class:`GranularOffloadOptimizer`: take back into the host store the
    host_params the engine replaced outside ``Module._apply`` (its bf16 cast). For its own groups (host_params outside
    DeepSpeed's optimizer): give them the zero-gradient step DeepSpeed's stage-0 unfused optimizer gave the other
    groups, fold their gradients into DeepSpeed's global gradient norm (so that clipping and the reported norm cover the
    whole model; an inf or NaN there makes DeepSpeed skip the step), drop them whenever DeepSpeed zeroes its gradients
    (after every step, a skipped one included) and reduce them in the engine's communication dtype over its
    data-parallel group (experts: their expert-data-parallel group, divided by the data-parallel size, as DeepSpeed
    does). Under model parallelism (the engine's mpu, a pipeline's grid) their norm is counted as DeepSpeed counts its
    own and summed over the model-parallel group, on every rank of it whether it has own groups or not. Nothing to
    do for other optimizers."""
    optimizer = ds_state.basic_optimizer(engine)
    if not isinstance(optimizer, GranularOffloadOptimizer):
        return
    ds_state.check_internals(engine, "granular_offload")
    if optimizer.host_params is not None:
        optimizer.host_params.adopt_all()
        if engine.zero_optimization_stage() == 0:  # the engine all-reduces every gradient, a missing one made on
            ds_state.before_gradient_reduction(engine, optimizer.host_params.give_missing_gradients)  # the host
    model_parallel_group, tensor_parallel_rank = ds_state.model_parallel(engine)
    wrapped = engine.optimizer is not optimizer  # DeepSpeed's ZeRO 1/2 or bf16 optimizer takes the norm
    if optimizer.own_param_groups or (model_parallel_group is not None and wrapped):
        # under model parallelism every rank of the group joins the own norm's all-reduce (a pipeline stage or a
        # slice may have no own groups while another has), wherever DeepSpeed's optimizer takes the norm
        optimizer.own_gradients.model_parallel_group = model_parallel_group
        optimizer.own_gradients.tensor_parallel_rank = tensor_parallel_rank
        optimizer.global_grad_norm = ds_state.include_in_gradient_norm(engine, optimizer.own_grad_norm)
    if optimizer.own_param_groups:
        if ds_state.steps_when_built(engine):
            optimizer.zero_gradient_step()
        ds_state.drop_gradients_with(engine, optimizer.drop_own_gradients)
        optimizer.communication_dtype = engine.communication_data_type
        optimizer.reduce_group = ds_state.data_parallel_group()
    if optimizer.ahead is not None:  # the host step during the backward: what it assumes, and when it may start
        optimizer.ahead.boundary = engine.is_gradient_accumulation_boundary
        optimizer.ahead.loss_scale = lambda: ds_state.current_loss_scale(engine)
        optimizer.ahead.keep_backups = optimizer.clip_grad > 0.0 or ds_state.may_skip_steps(engine)
        if optimizer.ahead.keep_backups:
            optimizer.ahead.reserve_backups(optimizer.own_param_groups)
    if optimizer.delayed is not None:
        optimizer.delayed.reserve(optimizer.own_param_groups)


def describe_offload_plan(plan: Optional[OffloadPlan]) -> str:
    """The plan as a table for logs (``"granular offload: off"`` for None)."""
    return "granular offload: off" if plan is None else describe_plan(plan)


__all__ = ["build_offload_optimizer", "offload_optimizer", "attach_to_engine", "describe_offload_plan", "model_groups",
           "param_group", "adam_arguments", "GranularOffloadOptimizer", "OffloadPlan", "PlacementLevel", "PlanError",
           "plan_placement"]
