"""DeepSpeed's PipelineModule: its layer specs, partition and stage's layers read, a module like it built from other
specs, its tied weights made equal over their stages. Builds modules, never an engine; reads no optimizer state (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from .guard import check_places


def is_pipeline_module(model) -> bool:
    return isinstance(model, PipelineModule)


def layer_specs(module: PipelineModule) -> List:
    """The module's layers as given to it: LayerSpec, TiedLayerSpec, built modules or functions, in order."""
    check_places("pipeline", {"PipelineModule": module})
    return list(module._layer_specs)


def pipeline_stage_layers(model: nn.Module) -> Optional[Tuple[List[Tuple[int, nn.Module]], int]]:
    """For a ``PipelineModule``: ``(index, layer)`` for each layer of its specs this stage built, and how many specs
    the whole pipeline has; None for any other module. ``PipelineModule._build`` registers each built ``LayerSpec``
    (or module) as a child named by its position among all the specs (its parameter names and per-layer checkpoint
    files use it); a ``TiedLayerSpec``'s module, built once per stage, lives in ``tied_modules``: it is the layer at
    each position of the stage whose spec has its key, provided that the stage calls it at every one of them (a
    ``forward_fn`` uses the module without calling it, past its hooks: such a module is no layer here). A plain
    function holds nothing."""
    if not is_pipeline_module(model):
        return None
    specs = layer_specs(model)
    own = range(model._local_start, model._local_stop)
    called = {spec.key for spec in specs if isinstance(spec, TiedLayerSpec)} - {
        specs[i].key for i in own if isinstance(specs[i], TiedLayerSpec) and specs[i].forward_fn is not None}
    children = dict(model.named_children())
    layers = []
    for index in own:
        spec = specs[index]
        if isinstance(spec, TiedLayerSpec):
            if spec.key in called:
                layers.append((index, model.tied_modules[spec.key]))
        elif str(index) in children:
            layers.append((index, children[str(index)]))
    return layers, len(specs)


def tied_across_stages(model: nn.Module) -> List[nn.Parameter]:
    """The parameters of this stage's tied modules that other stages hold too, whose gradients the pipeline engine
    all-reduces over those stages (``PipelineEngine._exec_reduce_tied_grads``, on ``.grad`` where it is set); none for
    any other module."""
    if not is_pipeline_module(model):
        return []
    return [p for comm in model.tied_comms.values() if len(comm["ranks"]) > 1 for p in comm["module"].parameters()]


def tied_spec(key: str, spec: LayerSpec, attributes: Sequence[str]) -> TiedLayerSpec:
    """``spec``'s layer as one of the layers that use the one module ``key`` stands for, all of whose
    ``attributes`` (parameter names) DeepSpeed makes equal where it is built and all-reduces the gradients of over
    the stages that hold it."""
    return TiedLayerSpec(key, spec.typename, *spec.module_args, tied_weight_attr=list(attributes),
                         **spec.module_kwargs)


def untied_spec(spec: LayerSpec) -> LayerSpec:
    return LayerSpec(spec.typename, *spec.module_args, **spec.module_kwargs)


def rebuild(module: PipelineModule, specs: Sequence, device: torch.device) -> PipelineModule:
    """A module of ``module``'s class built from ``specs`` on its topology, with its partition into stages, loss,
    layer seeding and activation checkpointing, and the attributes its class added; the random number generators
    are left as they were (the layers' initialization, and ``seed_layers``' reseeding, draw from forks of them:
    the CPU's and ``device``'s when it is a CUDA device).

    ``PipelineModule.__init__`` partitions the layers by a ``partition_method`` it does not keep: the old module's
    partition is handed in through its ``_partition_layers`` for the build."""
    parts = [int(p) for p in module.parts]
    cls = type(module)
    new = cls.__new__(cls)

    def same_partition(method=None):
        new.parts = parts
        new._set_bounds(start=parts[new.stage_id], stop=parts[new.stage_id + 1])

    object.__setattr__(new, "_partition_layers", same_partition)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        PipelineModule.__init__(
            new, layers=list(specs), topology=module._topo, loss_fn=module.loss_fn, seed_layers=module.seed_layers,
            seed_fn=module.seed_fn, base_seed=module.base_seed,
            activation_checkpoint_interval=module.activation_checkpoint_interval,
            activation_checkpoint_func=module.activation_checkpoint_func,
            checkpointable_layers=module.checkpointable_layers, dynamic_shape=module.dynamic_shape)
    del new.__dict__["_partition_layers"]
    for key, value in vars(module).items():  # the subclass's own; not what DeepSpeed's engine hung on the module
        if key not in vars(new) and not key.startswith(("ds_", "_ds", "__ds")):
            new.__dict__[key] = value
    return new


def synchronize_tied_weights(module: PipelineModule) -> None:
    """Collective over each tied module's stages: its tied parameters broadcast from the lowest rank holding it
    (on DeepSpeed's pipe-major topologies, the first stage that holds one of its layers)."""
    module._synchronize_tied_weights()


def total_parameter_numel(module: PipelineModule) -> int:
    """The pipeline's distinct parameter elements over its stages, what DeepSpeed's pipeline engine logs as
    UNIQUE_PARAMS: a collective over the module's model-parallel group, a tied module counted on the lowest rank
    that holds it only."""
    from deepspeed import comm

    local = sum(p.numel() for p in module.parameters())
    for tied in module.tied_comms.values():
        if module.global_rank != min(tied["ranks"]):
            local -= sum(p.numel() for p in tied["module"].parameters())
    total = torch.tensor([local], dtype=torch.long, device=next(module.parameters()).device)
    comm.all_reduce(total, group=module.mpu().get_model_parallel_group())
    return int(total.item())
