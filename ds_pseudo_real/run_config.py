"""The run's config, read and validated once where it comes in: ``initialize``, the main job, the ``plan`` command.

Owns: ``RunConfig``, the plugin's and the main job's sections as their pydantic models beside the dict DeepSpeed gets
and the facts DeepSpeed's sections decide (``TrainingFacts``). Must not build anything: the code below it takes the
typed parts it needs, never the JSON.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Union

import torch.distributed as dist

from .config import (
    MAIN_JOB_SECTIONS, PLUGIN_SECTIONS, SECTION, CheckpointOptions, ConfigError, PseudoToRealConfig,
    check_top_level_keys, load_ds_config, optional_section, parse_pseudo_to_real, split_checkpoint_options,
    validate_section,
)
from .data import DataSection
from .models.sections import MODEL_SECTIONS, GPTSection, ModelSection
from .offload.config import SECTION as OFFLOAD_SECTION, GranularOffloadConfig
from .training_facts import TrainingFacts


def data_parallel_size(mpu=None) -> int:
    """The ranks ZeRO partitions over: the mpu's data-parallel group, else the world (the process group's, else
    ``$WORLD_SIZE``)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return getattr(mpu, "get_data_parallel_world_size", lambda: world)()


@dataclass(frozen=True)
class RunConfig:
    """One DeepSpeed JSON, every section validated.

    ``deepspeed`` is what ``deepspeed.initialize`` gets: the file without the plugin's and the main job's sections
    and without the plugin's keys of DeepSpeed's ``checkpoint`` section, otherwise as given. ``granular_offload`` is
    None when the section is absent or disabled; ``model`` and ``data`` are the main job's (``gpt`` with its defaults
    and the byte corpus when absent).
    """

    deepspeed: Dict[str, Any]
    training: TrainingFacts
    pseudo_to_real: PseudoToRealConfig
    granular_offload: Optional[GranularOffloadConfig]
    checkpoint: CheckpointOptions
    model: ModelSection
    data: DataSection
    pseudo_to_real_given: bool = True  # False: the file has no pseudo_to_real section (the run says so)

    @classmethod
    def load(cls, config: Union[str, os.PathLike, Mapping[str, Any], "RunConfig"], *, world_size: Optional[int] = None,
             mpu=None) -> "RunConfig":
        """Read ``config`` (a path, a dict or a RunConfig) for a run on ``world_size``
        data-parallel ranks (default: :func:`data_parallel_size` of ``mpu``). Every problem is a ``ConfigError``
        naming the key, the value received and what is accepted. A RunConfig is returned as it is, or with this
        data-parallel size where it was read for another (its sections are not read again)."""
        if isinstance(config, RunConfig):
            size = world_size if world_size is not None else data_parallel_size(mpu)
            if config.training.data_parallel_size == size:
                return config
            return replace(config, training=replace(config.training, data_parallel_size=size))
        raw = load_ds_config(config)
        check_top_level_keys(raw)
        data_model = DataSection.model_for(raw.get("data", {}))
        pseudo_to_real = parse_pseudo_to_real(raw)
        granular_offload = optional_section(GranularOffloadConfig, OFFLOAD_SECTION, raw)
        without_plugin_keys, checkpoint = split_checkpoint_options(raw)
        data = validate_section(data_model, "data", raw.get("data", {}))
        chosen = [kind for kind in MODEL_SECTIONS if kind in raw]
        if len(chosen) > 1:
            raise ConfigError(f"the config has the model sections {chosen}; give one of {list(MODEL_SECTIONS)}")
        kind = chosen[0] if chosen else GPTSection.kind  # none: gpt with its defaults
        model = validate_section(MODEL_SECTIONS[kind], kind, raw.get(kind))
        deepspeed = {k: v for k, v in without_plugin_keys.items() if k not in PLUGIN_SECTIONS + MAIN_JOB_SECTIONS}
        training = TrainingFacts.from_deepspeed(deepspeed, world_size if world_size is not None else
                                                data_parallel_size(mpu))
        return cls(deepspeed, training, pseudo_to_real, granular_offload, checkpoint, model, data,
                   pseudo_to_real_given=SECTION in raw)
