"""The run's config, read and validated once where it comes in: ``initialize``, the main job, the ``plan`` command.

Owns: reading the JSON (a path or a dict), refusing top-level keys neither DeepSpeed nor the plugin knows, and
``RunConfig``: the plugin's and the main job's sections as their pydantic models beside the dict DeepSpeed gets and
the facts DeepSpeed's sections decide (``TrainingFacts``). Must not build anything: the code below it takes the
typed parts it needs, never the JSON.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Union

import torch.distributed as dist

from .config import (
    SECTION, CheckpointOptions, ConfigError, PseudoToRealConfig, optional_section, parse_pseudo_to_real,
    split_checkpoint_options, validate_section,
)
from .data import DataSection
from .models.sections import MODEL_SECTIONS, GPTSection, ModelSection
from .offload.config import SECTION as OFFLOAD_SECTION, GranularOffloadConfig
from .training_facts import TrainingFacts

# Sections of the plugin: read by ds_pseudo_real.initialize, or by the main job (the model and the data it trains).
PLUGIN_SECTIONS = ("pseudo_to_real", "granular_offload")
MAIN_JOB_SECTIONS = ("gpt", "m6", "hf", "data")
# The top-level keys DeepSpeed 0.19.8 reads (its config parsers, its monitors and its documented sections). DeepSpeed
# ignores any other key without a word, so a misspelled section would silently do nothing: the plugin refuses it.
DEEPSPEED_KEYS = frozenset("""
    activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet comms_logger communication_data_type
    compile compression_training csv_monitor curriculum_learning data_efficiency data_types dataloader_drop_last
    datastates_ckpt disable_allgather disable_python_gc dump_state eigenvalue elasticity expert_parallel
    flops_profiler fp16 gradient_accumulation_dtype gradient_accumulation_steps gradient_allreduce_op
    gradient_clipping gradient_predivide_factor graph_harvesting hybrid_engine log_level managed_gradient_accumulation
    memory_breakdown monitor_config nebula optimizer pipeline pld prescale_gradients progressive_layer_drop
    quantize_training scheduler seq_parallel_communication_data_type sequence_parallel_size sparse_attention
    sparse_gradients steps_per_print tensor_parallel tensorboard timers torch_autocast train_batch_size
    train_micro_batch_size_per_gpu use_data_before_expert_parallelism use_node_local_storage vocabulary_size
    wall_clock_breakdown wandb weight_quantization zenflow zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    zero_optimization
""".split())


def load_ds_config(config: Union[str, os.PathLike, Mapping[str, Any]]) -> Dict[str, Any]:
    """Read a DeepSpeed config given as a path or a dict into a fresh dict."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"DeepSpeed config file not found: {path!r}")
    with open(path) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as error:
            raise ConfigError(f"DeepSpeed config {path!r} is not valid JSON: {error}") from None


def check_top_level_keys(ds_config: Mapping[str, Any]) -> None:
    """Refuse a top-level key that neither DeepSpeed nor the plugin knows, naming the closest known one."""
    known = DEEPSPEED_KEYS | set(PLUGIN_SECTIONS) | set(MAIN_JOB_SECTIONS)
    lines = []
    for key in ds_config:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        sections = sorted(PLUGIN_SECTIONS + MAIN_JOB_SECTIONS)
        hint = f"did you mean {close[0]!r}?" if close else f"the plugin's sections are {sections}"
        lines.append(f"{key}: unknown top-level key, known to neither DeepSpeed nor ds_pseudo_real; {hint}")
    if lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))


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
        training.refuse_unscaled_fp16()
        return cls(deepspeed, training, pseudo_to_real, granular_offload, checkpoint, model, data,
                   pseudo_to_real_given=SECTION in raw)
