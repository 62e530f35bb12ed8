"""A DeepSpeed ``PipelineModule`` through the stages: its layers are the layer specs whose class matches
``pseudo_to_real.layers`` (``"type:<regex>"``, as DeepSpeed's ``partition_method``), tied per sharing group with
DeepSpeed's ``TiedLayerSpec`` in a pseudo stage and untied in the real one; each stage's module is rebuilt from
those specs on the same partition, and the delink maps parameters by names that say which layer they are.

Owns: which specs are the layers, a stage's specs, the mapped names, the stage builder of a PipelineModule. Must not
touch DeepSpeed's internals (``ds_state.pipeline`` does) nor checkpoints.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

from . import ds_state
from .config import ConfigError, PseudoToRealConfig
from .device import rank_device
from .ds_state import pipeline as ds_pipeline
from .sharing import group_leader
from .stages import RETIRED_MODULE, StageBuilder, fill_from
from .training_facts import TrainingFacts

if TYPE_CHECKING:
    from .offload.config import GranularOffloadConfig

TYPE_PREFIX = "type:"
# Where a layer's parameters sit in the names the delink maps: ``layers.<layer>.<its own name>``, whether the module
# holds the layer under its spec's index (``3.fc.weight``) or ties it (``tied_modules.pseudo_to_real_layer0.fc.weight``)
MAPPED_PATH = "layers"
# The key of a sharing group's TiedLayerSpec: this and the number of the group's first layer (a layer of the model)
TIE_KEY = "pseudo_to_real_layer"
REPLACED_MODULE = ("this PipelineModule was replaced by the pseudo model built from its layer specs; train, evaluate "
                   "and save through the engine ds_pseudo_real.initialize returned, and read the model as "
                   "engine.module")


def _class_name(spec) -> str:
    """The class name DeepSpeed's ``partition_method="type:..."`` matches for a layer spec."""
    if isinstance(spec, ds_pipeline.LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", "")


def layer_indices(specs: Sequence, layers: str) -> List[int]:
    """The positions in ``specs`` of the model's layers: the specs whose class name matches the regular expression
    of ``layers`` (``"type:<regex>"``, case-insensitive, as DeepSpeed's partition method), each a plain LayerSpec."""
    if not layers.startswith(TYPE_PREFIX):
        raise ConfigError(f"pseudo_to_real.layers: got {layers!r}; a PipelineModule names its layers by class, as "
                          f"DeepSpeed's partition_method does: '{TYPE_PREFIX}<regex of the class name>', e.g. "
                          f"'{TYPE_PREFIX}TransformerLayer'")
    pattern = re.compile(layers[len(TYPE_PREFIX):], re.IGNORECASE)
    found = [i for i, spec in enumerate(specs) if pattern.search(_class_name(spec))]
    if not found:
        raise ConfigError(f"pseudo_to_real.layers: {layers!r} matches none of the PipelineModule's layer classes "
                          f"{sorted({_class_name(s) for s in specs} - {''})}")
    wrong = {i: type(specs[i]).__name__ for i in found
             if not isinstance(specs[i], ds_pipeline.LayerSpec) or isinstance(specs[i], ds_pipeline.TiedLayerSpec)}
    if wrong:
        raise ConfigError(f"pseudo_to_real.layers: {layers!r} matches layers {wrong} of the PipelineModule; give "
                          f"each of them as a LayerSpec (not a TiedLayerSpec nor a built module): the plugin ties "
                          f"them per pseudo_to_real.groups and builds them again untied at the delink")
    return found


def layer_structure(spec) -> List[tuple]:
    """(name, shape) of every parameter of the layer ``spec`` builds, built on the meta device (no storage)."""
    with torch.device("meta"):
        layer = spec.build()
    return [(name, tuple(p.shape)) for name, p in layer.named_parameters(remove_duplicate=False)]


def stage_specs(specs: Sequence, indices: Sequence[int], groups: int, attributes: Sequence[str]) -> List:
    """The specs of the model whose layers (at ``indices``) form ``groups`` sets of consecutive layers: each set's
    layers one ``TiedLayerSpec`` (keyed by its first layer; ``attributes``: every parameter of a layer, all tied),
    every other spec as given; the specs untied when every layer is its own set."""
    out = list(specs)
    for layer, index in enumerate(indices):
        if groups == len(indices):
            out[index] = ds_pipeline.untied_spec(specs[index])
        else:
            key = f"{TIE_KEY}{group_leader(layer, len(indices), groups)}"
            out[index] = ds_pipeline.tied_spec(key, specs[index], attributes)
    return out


def mapped_name(name: str, layer_of: Mapping[int, int]) -> str:
    """The name the delink maps for a PipelineModule's parameter ``name``: ``layers.<layer>.<rest>`` for a layer's,
    from its spec index (``layer_of``: spec index -> layer) or its sharing group's tie key; others as they are."""
    head, _, rest = name.partition(".")
    if head.isdigit() and int(head) in layer_of:
        return f"{MAPPED_PATH}.{layer_of[int(head)]}.{rest}"
    key, _, inner = rest.partition(".")
    if head == "tied_modules" and key.startswith(TIE_KEY) and key[len(TIE_KEY):].isdigit():
        return f"{MAPPED_PATH}.{int(key[len(TIE_KEY):])}.{inner}"
    return name


class ByModelName(Mapping):
    """Values by mapped name, read by the names a model gives its parameters."""

    def __init__(self, values: Mapping[str, torch.Tensor], model: nn.Module, mapped):
        self._values, self._mapped = values, mapped
        self._names = [name for name, _ in model.named_parameters()]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._values[self._mapped(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class PipelineStageBuilder(StageBuilder):
    """:class:`~ds_pseudo_real.stages.StageBuilder` for a ``PipelineModule``: each stage's module is the caller's,
    rebuilt from its layer specs with the layers of every sharing group one ``TiedLayerSpec`` (DeepSpeed builds the
    group's module once on each stage that holds one of its layers and all-reduces its gradients over them), or
    untied. The delink, the carry of the weights and Adam moments, checkpoints: the base class's, over the mapped
    names. The data iterator DeepSpeed's ``train_batch`` reads goes on to the next stage's engine."""

    def _count_layers(self, model: nn.Module) -> int:
        self._specs = ds_pipeline.layer_specs(model)
        self._indices = layer_indices(self._specs, self.layer_path)
        self._layer_of = {index: layer for layer, index in enumerate(self._indices)}
        return len(self._indices)

    def _prepare(self, model: nn.Module, ptr_config: PseudoToRealConfig) -> nn.Module:
        """The first stage's module: with Pseudo-to-Real, the pseudo module built from the caller's specs, each
        group's values its first layer's (sent to every stage that holds the group); the caller's module retired."""
        self._refuse_unsupported(model, ptr_config)
        self._name_path = MAPPED_PATH
        self._internals = (*self._internals, "pipeline")
        self._data_iterator = None
        structures = {i: layer_structure(self._specs[i]) for i in self._indices}
        first = structures[self._indices[0]]
        differ = [self._layer_of[i] for i, structure in structures.items() if structure != first]
        if differ and ptr_config.enabled:
            raise ValueError(f"pseudo_to_real.layers: layers {differ} of the PipelineModule do not have the parameter "
                             f"names and shapes of layer 0, so they cannot share its parameters")
        rests = [name for name, _ in first]
        self._attributes = list(dict.fromkeys(rests))
        own = [self._mapped_name(name) for name, _ in model.named_parameters(remove_duplicate=False)]
        self._names = [f"{MAPPED_PATH}.{layer}.{rest}" for layer in range(self.num_layers) for rest in rests] + [
            name for name in own if not name.startswith(f"{MAPPED_PATH}.")]
        self._template = model  # what every stage's module is built like: class, topology, partition, loss
        if not ptr_config.enabled:
            return model
        pseudo = self._build_model(self.depth, self.groups, None)
        given = self._by_mapped_name(dict(model.named_parameters()))
        with torch.no_grad():
            for name, param in pseudo.named_parameters():
                value = given.get(self._mapped_name(name))
                if value is not None:  # a group's first layer on another stage: sent below
                    param.copy_(value)
        ds_pipeline.synchronize_tied_weights(pseudo)
        ds_state.retire_module(model, REPLACED_MODULE)
        return pseudo

    def _refuse_unsupported(self, model: nn.Module, ptr_config: PseudoToRealConfig) -> None:
        if self.depth < self.num_layers:
            raise ConfigError(f"pseudo_to_real.schedule[0].depth: got {self.depth}; a PipelineModule's layers are "
                              f"partitioned into stages once, so it grows no layers: give 'groups' instead")
        if any(trigger.at_tokens is not None for trigger in ptr_config.triggers):
            raise ConfigError("pseudo_to_real: at_tokens is not supported with a PipelineModule, whose batches only "
                              "its first and last stages read (train_batch): switch at_step or on_plateau")

    def _parameter_names(self) -> List[str]:
        return self._names

    def _mapped_name(self, name: str) -> str:
        return mapped_name(name, self._layer_of)

    def _total_parameter_numel(self, model: nn.Module) -> int:
        return ds_pipeline.total_parameter_numel(model)

    def _by_model_name(self, values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return ByModelName(values, self.engine.module, self._mapped_name)

    def _build_model(self, depth: int, groups: int, weights) -> nn.Module:
        specs = stage_specs(self._specs, self._indices, groups, self._attributes)
        model = ds_pipeline.rebuild(self._template, specs, rank_device())
        if weights is not None:
            fill_from([(p, self._mapped_name(name)) for name, p in model.named_parameters()], weights)
        return model

    def release(self, retired: str = RETIRED_MODULE) -> None:
        self._data_iterator = self.engine.data_iterator
        super().release(retired)

    def _new_engine(self, model: nn.Module, stage: str, training_data=None, collate_fn=None):
        loader = super()._new_engine(model, stage, training_data, collate_fn)
        iterator, self._data_iterator = self._data_iterator, None
        if iterator is not None and self.engine.data_iterator is None:
            self.engine.set_dataiterator(iterator)  # where train_batch() without an iterator reads on
        return loader


def stage_builder(model: nn.Module, ptr_config: PseudoToRealConfig,
                  granular_offload: Optional[GranularOffloadConfig], training: TrainingFacts,
                  ds_config: Dict[str, Any], **options) -> StageBuilder:
    """The stage builder for ``model``: a PipelineModule's, or the layer-list models' one (``options``: the
    keyword arguments of :class:`~ds_pseudo_real.stages.StageBuilder`)."""
    if ds_state.is_pipeline_module(model):
        return PipelineStageBuilder(model, ptr_config, granular_offload, training, ds_config, **options)
    return StageBuilder(model, ptr_config, granular_offload, training, ds_config, **options)


def model_parallel_unit(model: nn.Module, mpu=None):
    """The process groups the run is laid out on: ``mpu`` as given, else a PipelineModule's grid, which DeepSpeed's
    engine takes as its mpu (its data-parallel size is the one granular offload plans for)."""
    if mpu is None and ds_state.is_pipeline_module(model):
        return model.mpu()
    return mpu


__all__: Sequence[str] = ["PipelineStageBuilder", "layer_indices", "mapped_name", "model_parallel_unit",
                          "stage_specs", "stage_builder"]
