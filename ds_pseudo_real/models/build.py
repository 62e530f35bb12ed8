"""The model a config asks the main job to train, from its model section through the family that section names
(``models.registry``; ``gpt``, with its defaults, when the config has none).

Owns: the checks every family shares (activation recomputation against the config, the sharing groups against the
layers) around the family's own spec, and seeding the build. Must not know any family's section or model.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from ..config import ConfigError
from ..sharing import sharing_groups
from .registry import ModelSpec, family
from .sections import CHECKPOINT_KEY, ModelSection

__all__ = ["ModelSpec", "model_spec", "build_model", "parameter_total", "parameter_groups"]


def model_spec(config: Any, flags: Mapping[str, Optional[int]], vocab_size: int,
               eod: Optional[int] = None) -> ModelSpec:
    """The model of ``config``'s (a ``RunConfig``) model section (flags given on the command line win over the
    ``gpt`` section), checked against the data (``vocab_size`` and ``eod``, the end-of-document id, None for the
    byte corpus), the ranks and ``pseudo_to_real.groups``, which must divide the layer count."""
    section = config.model
    _check_activation_checkpointing(config, section)
    spec = family(section.kind).spec(section, flags, vocab_size, config.training.data_parallel_size, eod)
    spec.options[CHECKPOINT_KEY] = section.checkpoint_activations
    ptr = config.pseudo_to_real
    sharing_groups(spec.num_layers, ptr.groups if ptr.enabled else 1)
    return spec


def _check_activation_checkpointing(config: Any, section: ModelSection) -> None:
    """The main job recomputes activations when the model section says so; refuse the settings that would
    otherwise be silently ignored or would plan for other activations than the job keeps."""
    kind, checkpoint = section.kind, section.checkpoint_activations
    if "activation_checkpointing" in config.deepspeed:
        raise ConfigError(
            f"activation_checkpointing: the main job's models do not call DeepSpeed's activation checkpointing (its "
            f"reentrant recompute fires a shared parameter's gradient hook once per layer, which ZeRO 2/3 refuse), "
            f"so this section would change nothing; to recompute each layer in the backward set "
            f"\"{kind}\": {{\"{CHECKPOINT_KEY}\": true}} and remove the section")
    offload = config.granular_offload
    if offload is not None and offload.activations is not None:
        planned = offload.activations.checkpointing
        if planned != checkpoint:
            raise ConfigError(
                f"granular_offload.activations.checkpointing is {str(planned).lower()} but {kind}.{CHECKPOINT_KEY} is "
                f"{str(checkpoint).lower()}: the plan would count the activations of a model that "
                f"{'recomputes' if planned else 'keeps'} them, and this one "
                f"{'recomputes' if checkpoint else 'keeps'} them; make the two agree")


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return family(spec.kind).build(spec, seed)


def parameter_total(spec: ModelSpec) -> int:
    """The model's parameter count over all ranks, without allocating it (for the main job's check of a model
    against its data, before any rank builds it)."""
    return family(spec.kind).parameter_total(spec)


def parameter_groups(spec: ModelSpec) -> Optional[Callable[[nn.Module], List[Dict]]]:
    """The ``model_parameters`` callable ``ds_pseudo_real.initialize`` needs for this model (experts apart for M6)."""
    return family(spec.kind).parameter_groups(spec)
