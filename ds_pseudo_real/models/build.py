"""The model a config asks the main job to train: the ``gpt`` section (or flags, the default), ``m6`` or ``hf``.

Owns: turning the validated section (``sections``) into a :class:`ModelSpec` checked against the data, the ranks
and the flags (every error a ``ConfigError``, raised before any model is built) and building the model from it. The
models themselves live beside this module (``gpt``, ``m6``) or in Hugging Face ``transformers`` (an optional extra,
built from a local config, never downloaded).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..moe.architecture import PRESETS, M6Architecture
from ..sharing import sharing_groups
from .gpt import GPT, GPTConfig
from .sections import DEFAULT_SEQ_LEN, GPTSection, HFSection, M6Section, ModelSection

if TYPE_CHECKING:
    from ..run_config import RunConfig

CHECKPOINT_KEY = "checkpoint_activations"  # in every model section: recompute each layer in the backward
# Where the layer list of a Hugging Face causal LM lives, by config.model_type (inside the wrapper: "model.").
HF_LAYER_LISTS = {"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}


@dataclass
class ModelSpec:
    """What to build; ``layers`` is the dotted path of the layer list in the built model."""

    kind: str
    num_layers: int
    seq_len: int
    vocab_size: int
    layers: str = "layers"
    options: Dict[str, Any] = field(default_factory=dict)
    preset_vocab_size: Optional[int] = None  # a preset's vocabulary the data's replaced

    def describe(self) -> str:
        extra = ", ".join(f"{k} {v}" for k, v in self.options.items()
                          if k not in ("arch", "hf_config") and not (k == CHECKPOINT_KEY and not v))
        vocabulary = f"vocabulary {self.vocab_size}" + ("" if self.preset_vocab_size is None else (
            f" (the data's tokenizer's, in place of the preset {self.options['preset']}'s {self.preset_vocab_size})"))
        return f"{self.kind} model, {self.num_layers} layers, sequence {self.seq_len}, {vocabulary}" + (
            f", {extra}" if extra else "")


def model_spec(config: RunConfig, flags: Mapping[str, Optional[int]], vocab_size: int,
               eod: Optional[int] = None) -> ModelSpec:
    """The model of ``config``'s model section (flags given on the command line win over the ``gpt`` section),
    checked against the data (``vocab_size`` and ``eod``, the end-of-document id, None for the byte corpus), the
    ranks and ``pseudo_to_real.groups``, which must divide the layer count."""
    section = config.model
    _check_activation_checkpointing(config, section)
    build = {"gpt": _gpt_spec, "m6": _m6_spec, "hf": _hf_spec}[section.kind]
    spec = build(section, flags, vocab_size, config.training.data_parallel_size, eod)
    spec.options[CHECKPOINT_KEY] = section.checkpoint_activations
    ptr = config.pseudo_to_real
    sharing_groups(spec.num_layers, ptr.groups if ptr.enabled else 1)
    return spec


def _check_activation_checkpointing(config: RunConfig, section: ModelSection) -> None:
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


def _gpt_spec(section: GPTSection, flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    values = section.model_dump(exclude={CHECKPOINT_KEY})
    values.update({k: v for k, v in flags.items() if v is not None and k in values})
    if values["d_model"] % values["n_head"]:
        raise ConfigError(f"gpt.d_model ({values['d_model']}) must be divisible by gpt.n_head ({values['n_head']})")
    return ModelSpec("gpt", values["n_layer"], values["seq_len"], vocab_size, options=values)


def _m6_spec(section: M6Section, flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    if section.vocab_size is not None and section.vocab_size < vocab_size:
        raise ConfigError(f"m6.vocab_size: got {section.vocab_size}; the data's tokenizer has {vocab_size} tokens")
    preset = PRESETS.get(section.preset)
    replaced = preset.vocab_size if preset and section.vocab_size is None and preset.vocab_size != vocab_size \
        else None
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


def _hf_spec(section: HFSection, flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf: needs Hugging Face transformers: pip install 'ds_pseudo_real[hf]'") from None
    raw = section.config
    if isinstance(raw, str) and not os.path.exists(raw):  # never handed on: transformers would take it for a Hub id
        raise ConfigError(f"hf.config: no such folder {raw} ({os.path.abspath(raw)}: a relative path is read from the "
                          f"working directory); give a local folder with a config.json, or the config itself as a "
                          f"dict with model_type (the job never downloads one)")
    try:
        if isinstance(raw, str):
            config = transformers.AutoConfig.from_pretrained(raw, local_files_only=True)
        else:
            # the data's end-of-document token, not the model type's default ids (GPT-2's 50256 is outside any
            # smaller vocabulary), where the dict gives none: GPT-2 begins and ends its documents with it
            raw = {"bos_token_id": eod, "eos_token_id": eod, **raw}
            config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (KeyError, ValueError, OSError) as error:
        raise ConfigError(f"hf.config: {error}") from None
    if config.vocab_size < vocab_size:
        raise ConfigError(f"hf.config.vocab_size: got {config.vocab_size}; "
                          f"the data's tokenizer has {vocab_size} tokens")
    layers = section.layers or HF_LAYER_LISTS.get(config.model_type)
    if layers is None:
        raise ConfigError(f"hf.layers: cannot tell where the layer list of a {config.model_type!r} model is; "
                          f"name it, e.g. 'model.layers' (known: {HF_LAYER_LISTS})")
    seq_len = flags.get("seq_len") or min(DEFAULT_SEQ_LEN, getattr(config, "max_position_embeddings", DEFAULT_SEQ_LEN))
    num_layers = config.num_hidden_layers
    return ModelSpec("hf", num_layers, seq_len, config.vocab_size, layers=f"model.{layers}",
                     options={"model_type": config.model_type, "hf_config": config})


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM in the main job's calling convention: ``forward(idx, targets)`` -> loss (targets are
    the inputs shifted by one already), ``forward(idx)`` -> logits."""

    def __init__(self, config):
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.model(input_ids=idx).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _gpt_config(spec: ModelSpec) -> GPTConfig:
    o = spec.options
    return GPTConfig(vocab_size=spec.vocab_size, seq_len=spec.seq_len, n_layer=o["n_layer"], d_model=o["d_model"],
                     n_head=o["n_head"], mlp_ratio=o["mlp_ratio"], checkpoint_activations=o[CHECKPOINT_KEY])


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if spec.kind == "gpt":
        return GPT(_gpt_config(spec))
    if spec.kind == "m6":
        from .m6 import M6GPT

        o = spec.options
        arch: M6Architecture = o["arch"]
        return M6GPT(dataclasses.replace(arch, seq_length=spec.seq_len), ep_size=o["expert_parallel"],
                     capacity_factor=o["capacity_factor"], balance_coeff=o["balance_coeff"], seed=seed,
                     checkpoint_activations=o[CHECKPOINT_KEY])
    model = HFCausalLM(spec.options["hf_config"])
    if spec.options[CHECKPOINT_KEY]:  # the same recompute, through transformers' own switch
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def parameter_total(spec: ModelSpec) -> int:
    """The model's parameter count over all ranks, without allocating it (for the main job's check of a model
    against its data, before any rank builds it): the GPT and M6 from their shapes, a Hugging Face model built on
    the meta device."""
    if spec.kind == "gpt":
        return _gpt_config(spec).parameter_count()
    if spec.kind == "m6":
        from ..moe.architecture import total_parameters

        return total_parameters(spec.options["arch"])
    with torch.device("meta"):
        model = build_model(spec)
    return sum(p.numel() for p in model.parameters())


def parameter_groups(spec: ModelSpec) -> Optional[Callable[[nn.Module], List[Dict]]]:
    """The ``model_parameters`` callable ``ds_pseudo_real.initialize`` needs for this model (experts apart for M6)."""
    if spec.kind == "m6":
        from .m6 import moe_param_groups

        return moe_param_groups
    return None
