"""What DeepSpeed's own sections decide about the run, read once with DeepSpeed 0.19.8's rules.

Owns: ``TrainingFacts`` (ZeRO stage, working dtype, data-parallel size, DeepSpeed's own offloads, model-parallel
sizes, micro batch and gradient accumulation, fp16's loss scale, gradient clipping and whether a step can be skipped) from a DeepSpeed config dict, and the refusal of
what DeepSpeed accepts but trains wrongly. Must not validate what DeepSpeed validates itself, nor read the plugin's
sections.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .config import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _read_only(mapping: Any) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class TrainingFacts:
    """The run as DeepSpeed will set it up on ``data_parallel_size`` ranks.

    ``micro_batch`` and ``gradient_accumulation_steps`` are derived when first read (they can refuse the config,
    and only the main job and granular offload need them): DeepSpeed checks its batch keys itself otherwise.
    """

    data_parallel_size: int
    zero_stage: int = 0
    dtype: str = "fp32"  # the working dtype: "bf16", "fp16" or "fp32"
    # zero_optimization's offload keys whose device is other than "none", as given
    deepspeed_offloads: Mapping[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # tensor_parallel.autotp_size
    sequence_parallel_size: int = 1
    # as given: granular offload's planner reads DeepSpeed's gradient bucket keys from it (offload.config)
    zero_optimization: Mapping[str, Any] = field(default_factory=dict)
    batch: Mapping[str, Any] = field(default_factory=dict)  # the given ones of BATCH_KEYS
    loss_scale: float = 0.0  # fp16.loss_scale as given: 0 is dynamic loss scaling (DeepSpeed's default)
    gradient_clipping: float = 0.0  # as given: 0 is none
    # DeepSpeed skips a step on an inf or NaN gradient: fp16, and bf16 with bf16.check_grad_overflow (default true;
    # read at ZeRO 1/2, ``engine._configure_zero_optimizer``)
    skips_overflowed_steps: bool = False

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any], data_parallel_size: int) -> "TrainingFacts":
        zero = ds_config.get("zero_optimization") or {}
        bf16_section = ds_config.get("bf16") or ds_config.get("bfloat16") or {}  # DeepSpeed takes both
        bf16 = bf16_section.get("enabled")
        dtype = "bf16" if bf16 else "fp16" if (ds_config.get("fp16") or {}).get("enabled") else "fp32"
        offloads = {key: zero[key] for key in OFFLOAD_KEYS if zero.get(key) and (
            zero[key].get("device", "none") if isinstance(zero[key], Mapping) else zero[key]) != "none"}
        return cls(
            data_parallel_size=data_parallel_size,
            zero_stage=zero.get("stage", 0),
            dtype=dtype,
            deepspeed_offloads=_read_only(offloads),
            tensor_parallel_size=(ds_config.get("tensor_parallel") or {}).get("autotp_size", 1),
            sequence_parallel_size=ds_config.get("sequence_parallel_size", 1),
            zero_optimization=_read_only(zero),
            batch=_read_only({key: ds_config[key] for key in BATCH_KEYS if ds_config.get(key) is not None}),
            loss_scale=(ds_config.get("fp16") or {}).get("loss_scale", 0.0),
            gradient_clipping=ds_config.get("gradient_clipping") or 0.0,
            skips_overflowed_steps=dtype == "fp16" or (dtype == "bf16" and zero.get("stage", 0) in (1, 2)
                                                       and bool(bf16_section.get("check_grad_overflow", True))),
        )

    def refuse_unscaled_fp16(self) -> None:
        """Refuse fp16 with loss scaling at ZeRO stage 0, which DeepSpeed 0.19.8 trains wrongly: its
        ``engine.backward`` scales the loss only for its ZeRO optimizers (``ZeROOptimizer.scale_if_loss``), while the
        stage-0 fp16 optimizers (``FP16_UnfusedOptimizer``, ``FP16_Optimizer``) divide the gradients by the loss
        scale before the step (deepspeedai/DeepSpeed pull request 8393, open). Measured in tests/test_fp16.py: after
        ``engine.backward`` at stage 0 the fp16 gradients are the loss's own, unscaled."""
        if self.dtype == "fp16" and self.zero_stage == 0 and self.loss_scale != 1:
            scaling = "dynamic loss scaling" if not self.loss_scale else f"loss_scale {self.loss_scale!r}"
            raise ConfigError(
                f"invalid config:\n  zero_optimization.stage: got 0 with fp16.enabled and {scaling}; DeepSpeed 0.19.8 "
                f"does not scale the loss at stage 0 (engine.backward scales it for its ZeRO optimizers only) but "
                f"divides the gradients by the loss scale there (deepspeedai/DeepSpeed#8393): every update would be "
                f"the scale times too small and fp16 gradients unprotected from underflow; accepted: "
                f"zero_optimization.stage 1, 2 or 3 with fp16 (stage 1 on one rank keeps what stage 0 keeps), bf16 "
                f"or fp32 at stage 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype DeepSpeed trains the model's parameters in."""
        return TORCH_DTYPES[self.dtype]

    @cached_property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step, as DeepSpeed 0.19.8 derives them (``runtime/config.py``
        ``_set_batch_related_parameters``, ``_batch_assertion``): the key left out of ``train_batch_size`` = micro
        batch x ``gradient_accumulation_steps`` x data-parallel size follows from the other two (1 when only one
        batch size is given), and all three must agree. Without ``train_batch_size``, ``gradient_accumulation_steps``
        or 1 (DeepSpeed also wants a batch size, which the offload plan does not need)."""
        for key, value in self.batch.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"invalid config:\n  {key}: got {value!r}; accepted: an integer >= 1")
        batch, micro, steps = (self.batch.get(key) for key in BATCH_KEYS)
        world_size = self.data_parallel_size
        if batch is None or world_size < 1:  # TrainingSetup refuses a data-parallel size < 1
            return steps or 1
        if micro is None:
            steps = steps or 1
            micro = batch // world_size // steps
        elif steps is None:
            steps = batch // micro // world_size
        if batch != micro * steps * world_size:
            derived = {key: " (derived)" if key not in self.batch else "" for key in BATCH_KEYS}
            raise ConfigError(
                f"invalid config:\n  train_batch_size: got {batch}, but train_micro_batch_size_per_gpu {micro}"
                f"{derived['train_micro_batch_size_per_gpu']} x gradient_accumulation_steps {steps}"
                f"{derived['gradient_accumulation_steps']} x data-parallel size {world_size} = "
                f"{micro * steps * world_size}; accepted: train_batch_size equal to that product, as DeepSpeed "
                f"requires")
        return steps

    @cached_property
    def micro_batch(self) -> int:
        """The micro batch per rank: ``train_micro_batch_size_per_gpu``, else derived from ``train_batch_size``."""
        steps = self.gradient_accumulation_steps
        micro = self.batch.get("train_micro_batch_size_per_gpu")
        if micro is not None:
            return micro
        if self.batch.get("train_batch_size") is None:
            raise ConfigError("invalid config:\n  train_micro_batch_size_per_gpu: missing; give it or "
                              "train_batch_size (DeepSpeed needs one)")
        return self.batch["train_batch_size"] // (steps * self.data_parallel_size)
