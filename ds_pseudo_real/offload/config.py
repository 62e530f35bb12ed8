"""The ``granular_offload`` section of a DeepSpeed JSON config, and what the planner reads from the rest of it.

Owns: the pydantic model of the section (validated like DeepSpeed's own sections, errors through
``ds_pseudo_real.config``), turning it and the run's ``TrainingFacts`` into the planner's ``TrainingSetup`` (with
DeepSpeed 0.19.8's defaults for the gradient bucket keys it reads from ``zero_optimization``), and the placement the
section asks for. Must not build models, optimizers or engines.

    "granular_offload": {
        "device_memory": "32GB",          # plan within this budget per device (int bytes, "GB" = 1e9, "GiB" = 2**30)
        "levels": {"0": "device", "47": "host_optimizer", "other": "device"},   # ... or explicit levels instead
        "max_level": "host_params",       # furthest level the planner may use
        "activations": {"micro_batch": 1, "seq_len": 1024, "hidden": 1024, "heads": 16, "checkpointing": true},
        "reserved": "2GiB",               # kept free on the device (CUDA context, NCCL, fragmentation); default
                                          # planner.DEFAULT_RESERVED_BYTES (1 GiB) on CUDA, 0 on a CPU-only run
        "host_memory": "200GiB",          # refuse plans needing more host memory per rank (pinned: whole pages)
        "pcie_gb_per_s": 12, "cpu_adam_params_per_s": 5e8,   # the modelled step time (defaults in planner)
        "prefetch": true, "pin_memory": true,
        "host_step": "overlapped",        # own groups stepped during the backward (default "sequential": after it;
                                          # "delayed": during the next step's forward and backward, one step late)
        "delayed_from_step": 40,          # host_step "delayed": the optimizer steps run sequentially first
        "model": {"num_layers": 48, "layer_params": 4200000, "expert_params": 409000000, "expert_parallel": 512,
                  "other_params": 22000000, "shared_groups": 1}  # for the plan command only (per rank)
    }
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Union

from pydantic import Field, field_validator, model_validator

from ds_pseudo_real.config import ConfigError, SectionModel, optional_section
from ds_pseudo_real.offload.planner import (
    DEFAULT_CPU_ADAM_PARAMS_PER_S, DEFAULT_PCIE_BYTES_PER_S, DEFAULT_RESERVED_BYTES, DTYPE_BYTES, EXPERTS, OTHER,
    STREAM_POOL_BYTES, GroupSize, OffloadPlan, PlacementLevel, PlanError, TrainingSetup, estimate_activation_bytes,
    parse_bytes, place, plan_placement,
)
from ds_pseudo_real.training_facts import TrainingFacts

SECTION = "granular_offload"
ACCELERATORS = ("cuda", "cpu")
# zero_optimization defaults of DeepSpeed 0.19.8 (runtime/zero/config.py) that the byte model reads
REDUCE_BUCKET_SIZE = 500_000_000
CONTIGUOUS_GRADIENTS = True
# granular_offload.delayed_from_step: ZeRO-Offload (Ren et al. 2021) turns its delayed update on after the first tens
# of steps, where the gradients change fastest
DELAYED_FROM_STEP = 40


class ActivationEstimate(SectionModel):
    """Shape of one micro-batch, for the activation estimate of ``planner.estimate_activation_bytes``."""

    micro_batch: int = Field(..., ge=1)
    seq_len: int = Field(..., ge=1)
    hidden: int = Field(..., ge=1)
    heads: int = Field(..., ge=1)
    checkpointing: bool = False


class ModelSize(SectionModel):
    """Parameter counts per rank, for planning from a config without building the model (the ``plan`` command)."""

    num_layers: int = Field(..., ge=1)
    layer_params: int = Field(..., ge=1)
    other_params: int = Field(0, ge=0)
    shared_groups: Optional[int] = Field(None, ge=1)
    expert_params: int = Field(0, ge=0)  # per layer on one rank, planned as the layer's own "experts" group
    expert_parallel: int = Field(1, ge=1)  # ranks the experts are spread over: each is replicated world / this

    @model_validator(mode="after")
    def _groups_divide(self) -> "ModelSize":
        if self.shared_groups is not None and self.num_layers % self.shared_groups:
            raise ValueError(f"shared_groups ({self.shared_groups}) must divide num_layers ({self.num_layers})")
        return self


class GranularOffloadConfig(SectionModel):
    """Top-level ``"granular_offload"`` section: a budget to plan within, or explicit levels."""

    enabled: bool = True
    device_memory: Optional[int] = None
    levels: Optional[Union[List[str], Dict[str, str]]] = None
    max_level: PlacementLevel = Field(PlacementLevel.HOST_PARAMS, strict=False)  # JSON gives the level's name
    activations: Optional[ActivationEstimate] = None
    activation_bytes: Optional[int] = None
    reserved: Optional[int] = None  # None: DEFAULT_RESERVED_BYTES on CUDA, 0 on a CPU-only run
    host_memory: Optional[int] = None  # per rank
    pcie_gb_per_s: float = Field(DEFAULT_PCIE_BYTES_PER_S / 1e9, gt=0)
    cpu_adam_params_per_s: float = Field(DEFAULT_CPU_ADAM_PARAMS_PER_S, gt=0)
    prefetch: bool = True
    pin_memory: bool = True
    host_step: Literal["sequential", "overlapped", "delayed"] = "sequential"
    delayed_from_step: int = Field(DELAYED_FROM_STEP, ge=0)
    model: Optional[ModelSize] = None

    @field_validator("device_memory", "activation_bytes", "reserved", "host_memory", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("levels", mode="before")
    @classmethod
    def _levels(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, (list, dict)):
            raise ValueError("expected a list with one level per layer or a dict {layer index or 'other': level}")
        accepted = [level.value for level in PlacementLevel]
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, level in items:
            if isinstance(value, dict) and key != OTHER and not re.fullmatch(r"\d+(\.experts)?", str(key)):
                raise ValueError(f"key {key!r}: accepted keys are layer indices ('0', '1', ...), a layer's experts "
                                 f"('0.experts') and {OTHER!r}")
            if level not in accepted:
                raise ValueError(f"[{key!r}] is {level!r}; accepted levels: {accepted}")
        return value

    @model_validator(mode="after")
    def _one_way_to_plan(self) -> "GranularOffloadConfig":
        if self.enabled and (self.device_memory is None) == (self.levels is None):
            raise ValueError("give exactly one of device_memory (plan within a budget) or levels (explicit placement)")
        if self.activations is not None and self.activation_bytes is not None:
            raise ValueError("give at most one of activations (estimated) or activation_bytes (measured)")
        if "delayed_from_step" in self.model_fields_set and self.host_step != "delayed":
            raise ValueError(f"delayed_from_step is read with host_step 'delayed' only; got host_step "
                             f"{self.host_step!r}")
        return self


def parse_granular_offload(ds_config: Mapping[str, Any]) -> Optional[GranularOffloadConfig]:
    """The validated section, or None when it is absent or ``enabled`` is false."""
    return optional_section(GranularOffloadConfig, SECTION, ds_config)


def _zero_key(zero: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    """``zero_optimization[key]`` checked as DeepSpeed would: a bool, or an element count > 0 (5e8 accepted)."""
    value = zero.get(key, default)
    if value is None:
        return default
    if kind is bool and isinstance(value, bool):
        return value
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind is int and not isinstance(value, bool) and integral and value > 0:
        return int(value)
    accepted = "true or false" if kind is bool else "an element count > 0, e.g. 500000000 or 5e8"
    raise ConfigError(f"invalid config:\n  zero_optimization.{key}: got {value!r}; accepted: {accepted}")


def default_accelerator() -> str:
    """The accelerator this process runs on, as the offload optimizer sees it (CUDA when torch finds it)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def training_setup(section: GranularOffloadConfig, training: TrainingFacts, num_layers: int,
                   accelerator: Optional[str] = None) -> TrainingSetup:
    """The planner's view of the run: dtype, ZeRO stage, data-parallel size and micro-batches per optimizer step
    from ``training``, DeepSpeed's reduce bucket from its ``zero_optimization`` keys, and the section's own figures
    (the activation estimate for ``num_layers`` layers).

    ``accelerator`` (default: this process's, ``default_accelerator()``): ``"cuda"`` counts the overheads only a
    CUDA device has: the ``reserved`` default, pinned host buffers in whole pages (with ``pin_memory``; without it
    the copies are synchronous, which the plan says), the side streams' allocator pools, and DeepSpeed's reduce
    bucket (on the CPU, ``torch.empty``'s pages are committed only where gradients are written into it, so it is
    not counted). ``"cpu"`` plans a CPU-only run.
    """
    accelerator = accelerator or default_accelerator()
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator: got {accelerator!r}, accepted: {list(ACCELERATORS)}")
    cuda = accelerator == "cuda"
    if training.deepspeed_offloads:
        key, value = next(iter(training.deepspeed_offloads.items()))
        raise ConfigError(f"invalid config:\n  zero_optimization.{key}: got {value!r}, but {SECTION} places "
                          f"optimizer state and parameters itself; accepted: absent or {{\"device\": \"none\"}}")
    training.refuse_unscaled_fp16()
    dtype, stage, zero = training.dtype, training.zero_stage, training.zero_optimization
    if section.activations is not None:
        a = section.activations
        activation = estimate_activation_bytes(a.micro_batch, a.seq_len, a.hidden, a.heads, num_layers, dtype,
                                               a.checkpointing)
    else:
        activation = section.activation_bytes or 0
    reduce_bucket = 0
    if cuda and stage in (1, 2) and _zero_key(zero, "contiguous_gradients", CONTIGUOUS_GRADIENTS, bool):
        buffers = 2 if _zero_key(zero, "overlap_comm", False, bool) else 1  # DeepSpeed: None -> stage == 3
        reduce_bucket = buffers * _zero_key(zero, "reduce_bucket_size", REDUCE_BUCKET_SIZE, int) * DTYPE_BYTES[dtype]
    reserved = section.reserved if section.reserved is not None else (DEFAULT_RESERVED_BYTES if cuda else 0)
    accumulation = training.gradient_accumulation_steps
    try:
        return TrainingSetup(
            dtype, stage, training.data_parallel_size, activation, reserved, reduce_bucket_bytes=reduce_bucket,
            stream_pool_bytes=STREAM_POOL_BYTES if cuda else 0, pinned_host=cuda and section.pin_memory,
            pageable_copies=cuda and not section.pin_memory,
            host_memory_bytes=section.host_memory, pcie_bytes_per_s=section.pcie_gb_per_s * 1e9,
            cpu_adam_params_per_s=section.cpu_adam_params_per_s, gradient_accumulation_steps=accumulation,
            host_step=section.host_step, host_step_backups=section.host_step == "overlapped" and (
                training.gradient_clipping > 0 or training.skips_overflowed_steps))
    except PlanError as error:
        raise ConfigError(f"invalid config:\n  {error}") from None


def planned_placement(section: GranularOffloadConfig, groups: Sequence[GroupSize], setup: TrainingSetup,
                      num_layers: Optional[int] = None) -> OffloadPlan:
    """The placement the section asks for: its explicit ``levels`` (:func:`explicit_levels`), else the planner's
    within ``device_memory`` up to ``max_level``. Raises :class:`PlanError` (with the furthest placement tried)
    when it does not fit."""
    if section.levels is not None:
        levels = explicit_levels(section, groups, num_layers)
        return place(groups, levels, setup)
    return plan_placement(groups, setup, section.device_memory, PlacementLevel(section.max_level))


def explicit_levels(section: GranularOffloadConfig, groups: Sequence[GroupSize],
                    num_layers: Optional[int] = None) -> Dict[str, PlacementLevel]:
    """Map ``section.levels`` onto group names: a list covers the layers' dense groups; a dict is keyed by layer
    index, ``'<index>.experts'`` (that layer's MoE experts) or ``'other'``. Groups not named stay on the device.

    ``num_layers``: the model's layer count when its groups are those of a pseudo model. Levels may then be
    given for all its layers (as for the real model the same config delinks into); a shared set takes the level
    of its first layer and the other layers' entries wait for the real stage.
    """
    layers = [g for g in groups if g.is_layer and not g.is_experts]
    if isinstance(section.levels, list):
        if len(section.levels) == len(layers):
            return {g.name: PlacementLevel(level) for g, level in zip(layers, section.levels)}
        if num_layers is not None and len(section.levels) == num_layers:
            return {g.name: PlacementLevel(section.levels[g.index]) for g in layers}
        raise ConfigError(f"invalid config:\n  {SECTION}.levels: got a list of {len(section.levels)} levels, "
                          f"the model has {num_layers or len(layers)} layers; accepted: one level per layer, or a dict")
    names = {g.name[len("layer"):] if g.is_layer else OTHER: g.name for g in groups}
    later = {str(i) for i in range(num_layers or 0)}  # layers whose parameters a leader holds
    if any(g.is_experts for g in groups):
        later |= {f"{i}{EXPERTS}" for i in range(num_layers or 0)}
    later -= set(names)
    unknown = [k for k in section.levels if k not in names and k not in later]
    if unknown:
        raise ConfigError(f"invalid config:\n  {SECTION}.levels: got keys {unknown} not in the model; "
                          f"accepted: {sorted(set(names) | later, key=lambda k: (k == OTHER, k.endswith(EXPERTS), len(k), k))}")
    return {names[k]: PlacementLevel(v) for k, v in section.levels.items() if k in names}
