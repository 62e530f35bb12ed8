"""The run's config, read and validated once where it comes in: ``initialize``, the main job, the ``plan`` command.

Owns: reading the JSON (a path or a dict), refusing top-level keys neither DeepSpeed nor the plugin knows, and
``RunConfig``: the plugin's and the main job's sections as their pydantic models beside the dict DeepSpeed gets and
the facts DeepSpeed's sections decide (``TrainingFacts``). Must not build anything: the code below it takes the
typed parts it needs, never the JSON.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch.distributed as dist
from pydantic import ValidationError

from .config import (
    SECTION, CheckpointOptions, ConfigError, PseudoToRealConfig, closest_key, model_keys, optional_section,
    parse_pseudo_to_real, split_checkpoint_options, validate_section,
)
from .data import DataSection
from .models.registry import model_sections
from .models.sections import ModelSection
from .offload.config import SECTION as OFFLOAD_SECTION, GranularOffloadConfig
from .training_facts import TrainingFacts

# Sections of the plugin: read by ds_pseudo_real.initialize, or by the main job (the model and the data it trains).
PLUGIN_SECTIONS = ("pseudo_to_real", "granular_offload")
DEFAULT_MODEL = "gpt"  # the family the main job trains when the config has no model section


def main_job_sections() -> tuple:
    """The main job's sections: every registered model family's, and ``data``."""
    return (*model_sections(), "data")

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
    known = DEEPSPEED_KEYS | set(PLUGIN_SECTIONS) | set(main_job_sections())
    lines = []
    for key in ds_config:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        sections = sorted(PLUGIN_SECTIONS + main_job_sections())
        hint = f"did you mean {close[0]!r}?" if close else f"the plugin's sections are {sections}"
        lines.append(f"{key}: unknown top-level key, known to neither DeepSpeed nor ds_pseudo_real; {hint}")
    if lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))


def check_deepspeed_sections(ds_config: Mapping[str, Any], micro_batch: int, accumulation: int) -> None:
    """DeepSpeed's own sections validated by its config class, as ``deepspeed.initialize`` will, before any rank
    starts. That class takes the world size from the process group, which a check before the ranks start has not:
    it is given the micro batch and accumulation steps resolved already, and derives train_batch_size from them. A
    problem is a ConfigError with one line per problem, naming the key where it is in the file
    (``zero_optimization.stgae``) and, for an unknown one, the closest key DeepSpeed takes there."""
    from deepspeed.runtime.config import DeepSpeedConfig

    resolved = {key: value for key, value in copy.deepcopy(dict(ds_config)).items() if key != "train_batch_size"}
    try:
        DeepSpeedConfig({**resolved, "train_micro_batch_size_per_gpu": micro_batch,
                         "gradient_accumulation_steps": accumulation})
    except ValidationError as error:  # a DeepSpeed section's model, e.g. DeepSpeedZeroConfig for zero_optimization
        lines = [_deepspeed_problem(ds_config, error.title, e) for e in error.errors()]
        raise ConfigError(f"invalid config: DeepSpeed's {error.title} refuses\n  " + "\n  ".join(lines)) from None
    except (ValueError, AssertionError) as error:
        raise ConfigError(f"invalid config: DeepSpeed refuses it: {error}") from None


def _deepspeed_problem(ds_config: Mapping[str, Any], model_name: str, problem: Mapping[str, Any]) -> str:
    """DeepSpeed's words for one problem (its model's location, message and value), then where the key is in the
    file, and for an unknown key the closest one that model takes there."""
    loc = [str(part) for part in problem["loc"]]
    line = f"{'.'.join(loc)}: {problem['msg']} (got {problem.get('input')!r})"
    sections = _sections_holding(ds_config, problem["loc"], problem.get("input"))
    if len(sections) != 1:
        return line
    if sections[0]:  # a location inside a section (DeepSpeedMonitorConfig's start at the top level)
        line += f", at {'.'.join([sections[0], *loc])}"
    if problem["type"] == "extra_forbidden":
        model = _deepspeed_model(model_name)
        line += closest_key(problem["loc"], model_keys(model, problem["loc"][:-1]) if model else [], sections[0])
    return line


def _sections_holding(ds_config: Mapping[str, Any], loc: Sequence[Any], value: Any) -> List[str]:
    """The top-level keys of ``ds_config`` under which ``loc`` leads to ``value`` ("" for the top level itself):
    where in the file a problem DeepSpeed reports for one of its section models (whose location mostly starts
    inside the section) is."""
    found = []
    for key, section in [("", ds_config), *ds_config.items()]:
        for part in loc:
            if isinstance(section, Mapping) and part in section:
                section = section[part]
            elif isinstance(section, list) and isinstance(part, int) and part < len(section):
                section = section[part]
            else:
                break
        else:
            if section == value:
                found.append(key)
    return found


def _deepspeed_model(name: str) -> Optional[type]:
    """DeepSpeed's config model class called ``name`` (a subclass of its ``DeepSpeedConfigModel``), if loaded."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    pending = [DeepSpeedConfigModel]
    while pending:
        model = pending.pop()
        if model.__name__ == name:
            return model
        pending.extend(model.__subclasses__())
    return None


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
        sections = model_sections()
        chosen = [kind for kind in sections if kind in raw]
        if len(chosen) > 1:
            raise ConfigError(f"the config has the model sections {chosen}; give one of {list(sections)}")
        kind = chosen[0] if chosen else DEFAULT_MODEL  # none: gpt with its defaults
        model = validate_section(sections[kind], kind, raw.get(kind))
        ignored = PLUGIN_SECTIONS + main_job_sections()
        deepspeed = {k: v for k, v in without_plugin_keys.items() if k not in ignored}
        training = TrainingFacts.from_deepspeed(deepspeed, world_size if world_size is not None else
                                                data_parallel_size(mpu))
        training.refuse_unscaled_fp16()
        return cls(deepspeed, training, pseudo_to_real, granular_offload, checkpoint, model, data,
                   pseudo_to_real_given=SECTION in raw)
