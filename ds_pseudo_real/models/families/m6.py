"""The M6 expert-prototyping MoE (``models.m6``, on DeepSpeed's MoE): the ``m6`` section, a preset with overrides of
its architecture or every field, and how the job spreads its experts."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, Mapping, Optional

import torch
from pydantic import Field

from ...config import ConfigError
from ...moe.architecture import PRESETS, M6Architecture, architecture_from_dict, total_parameters
from ..registry import ModelFamily, ModelSpec, register
from ..sections import CHECKPOINT_KEY, ModelSection, count

PresetName = Literal[tuple(PRESETS)]


class M6Section(ModelSection):
    """The M6 expert-prototyping MoE: a ``preset`` with overrides of its :class:`M6Architecture` fields, or every
    field; and how the job runs it."""

    kind: ClassVar[str] = "m6"
    preset: Optional[PresetName] = None
    name: Optional[str] = None
    num_layers: Optional[int] = count()
    hidden_size: Optional[int] = count()
    num_heads: Optional[int] = count()
    expert_ffn_size: Optional[int] = count()
    num_experts: Optional[int] = count()
    num_prototypes: Optional[int] = count()
    vocab_size: Optional[int] = count()
    seq_length: Optional[int] = count()
    expert_parallel: Optional[int] = count()  # None: the job takes gcd(ranks, experts)
    capacity_factor: float = Field(1.25, gt=0)
    balance_coeff: float = Field(0.01, ge=0)

    def architecture(self, **overrides: Any) -> M6Architecture:
        """The architecture the section describes, with ``overrides`` of its fields (``architecture_from_dict``:
        a ``TypeError`` names a field missing without a preset)."""
        keys = {"preset", *(name for name in M6Architecture.__dataclass_fields__)}
        return architecture_from_dict({**self.model_dump(include=keys, exclude_none=True), **overrides})


def m6_spec(section: M6Section, flags: Mapping[str, Optional[int]], vocab_size: int, world_size: int,
            eod: Optional[int]) -> ModelSpec:
    if section.vocab_size is not None and section.vocab_size < vocab_size:
        raise ConfigError(f"m6.vocab_size: got {section.vocab_size}; the data's tokenizer has {vocab_size} tokens")
    preset = PRESETS.get(section.preset)
    replaced = (preset.vocab_size if preset and section.vocab_size is None and preset.vocab_size != vocab_size
                else None)
    overrides = {"vocab_size": section.vocab_size or vocab_size}
    if flags.get("seq_len") is not None:
        overrides["seq_length"] = flags["seq_len"]
    try:
        arch = section.architecture(**overrides)
    except TypeError as error:  # a field missing without a preset
        raise ConfigError(f"m6: {error}; give a preset ({'m6-tiny', 'm6-1t-like', 'm6-10t'}) or every field") from None
    ep = section.expert_parallel
    if ep is None:
        ep = math.gcd(world_size, arch.num_experts)
    elif arch.num_experts % ep or world_size % ep:
        accepted = [k for k in range(1, world_size + 1) if world_size % k == 0 and arch.num_experts % k == 0]
        raise ConfigError(f"m6.expert_parallel: got {ep!r}; it must divide both the {arch.num_experts} experts and "
                          f"the {world_size} ranks (accepted: {accepted})")
    return ModelSpec("m6", arch.num_layers, arch.seq_length, arch.vocab_size,
                     options={"preset": arch.name, "expert_parallel": ep, "capacity_factor": section.capacity_factor,
                              "balance_coeff": section.balance_coeff, "arch": arch}, preset_vocab_size=replaced)


def build_m6(spec: ModelSpec, seed: int) -> torch.nn.Module:
    from ..m6 import M6GPT  # DeepSpeed's MoE: imported when a model is built, not when a config is read

    o = spec.options
    return M6GPT(dataclasses.replace(o["arch"], seq_length=spec.seq_len), ep_size=o["expert_parallel"],
                 capacity_factor=o["capacity_factor"], balance_coeff=o["balance_coeff"], seed=seed,
                 checkpoint_activations=o[CHECKPOINT_KEY])


def m6_parameter_groups(spec: ModelSpec):
    from ..m6 import moe_param_groups  # the experts apart, as DeepSpeed's MoE needs them

    return moe_param_groups


FAMILY = register(ModelFamily(
    section=M6Section, spec=m6_spec, build=build_m6, parameter_total=lambda spec: total_parameters(spec.options["arch"]),
    parameter_groups=m6_parameter_groups,
    docs_row='| `"m6": {"preset": "m6-tiny" \\| "m6-1t-like" \\| "m6-10t", ...field overrides, "expert_parallel": N, '
             '"capacity_factor": 1.25, "balance_coeff": 0.01}` | the M6 expert-prototyping MoE on DeepSpeed\'s MoE: '
             'attention without biases, every MLP an MoE of `num_experts` in `num_prototypes` prototypes (top-1 in '
             'each), the head tied to the embedding; experts spread over `expert_parallel` ranks (default: the '
             'greatest common divisor of the rank count and the experts) |'))
