"""The model a config asks the main job to train: the ``gpt`` section (or flags, the default), ``m6`` or ``hf``.

Owns: reading those sections into a validated :class:`ModelSpec` (every error a ``ConfigError``, raised before any
model is built) and building the model from it. The models themselves live beside this module (``gpt``, ``m6``) or
in Hugging Face ``transformers`` (an optional extra, built from a local config, never downloaded).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..moe.architecture import PRESETS, M6Architecture, architecture_from_dict
from ..sharing import sharing_groups
from .gpt import GPT, GPTConfig

MODEL_SECTIONS = ("gpt", "m6", "hf")
GPT_KEYS = ("n_layer", "d_model", "n_head", "seq_len", "mlp_ratio")
CHECKPOINT_KEY = "checkpoint_activations"  # in every model section: recompute each layer in the backward
M6_RUN_KEYS = {"expert_parallel": None, "capacity_factor": 1.25, "balance_coeff": 0.01}
# Where the layer list of a Hugging Face causal LM lives, by config.model_type (inside the wrapper: "model.").
HF_LAYER_LISTS = {"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}
DEFAULT_SEQ_LEN = 128


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


def model_spec(ds_config: Mapping[str, Any], flags: Mapping[str, Optional[int]], vocab_size: int,
               world_size: int, groups: int = 1, eod: Optional[int] = None) -> ModelSpec:
    """Validate the model sections of ``ds_config`` (flags given on the command line win over the ``gpt`` section)
    and that ``groups`` (``pseudo_to_real.groups``) divides the layer count. ``vocab_size`` and ``eod`` (the
    end-of-document id, None for the byte corpus) are the data's."""
    chosen = [s for s in MODEL_SECTIONS if s in ds_config]
    if len(chosen) > 1:
        raise ConfigError(f"the config has the model sections {chosen}; give one of {list(MODEL_SECTIONS)}")
    kind = chosen[0] if chosen else "gpt"
    section = ds_config.get(kind) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"invalid config:\n  {kind}: expected an object, got {section!r}")
    section = dict(section)
    checkpoint = section.pop(CHECKPOINT_KEY, False)
    if not isinstance(checkpoint, bool):
        raise ConfigError(f"{kind}.{CHECKPOINT_KEY}: got {checkpoint!r}; expected true or false")
    _check_activation_checkpointing(ds_config, kind, checkpoint)
    spec = {"gpt": _gpt_spec, "m6": _m6_spec, "hf": _hf_spec}[kind](section, flags, vocab_size, world_size, eod)
    spec.options[CHECKPOINT_KEY] = checkpoint
    sharing_groups(spec.num_layers, groups)
    return spec


def _check_activation_checkpointing(ds_config: Mapping[str, Any], kind: str, checkpoint: bool) -> None:
    """The main job recomputes activations when the model section says so; refuse the settings that would
    otherwise be silently ignored or would plan for other activations than the job keeps."""
    if "activation_checkpointing" in ds_config:
        raise ConfigError(
            f"activation_checkpointing: the main job's models do not call DeepSpeed's activation checkpointing (its "
            f"reentrant recompute fires a shared parameter's gradient hook once per layer, which ZeRO 2/3 refuse), "
            f"so this section would change nothing; to recompute each layer in the backward set "
            f"\"{kind}\": {{\"{CHECKPOINT_KEY}\": true}} and remove the section")
    offload = ds_config.get("granular_offload")
    activations = offload.get("activations") if isinstance(offload, Mapping) else None
    if isinstance(activations, Mapping):
        planned = bool(activations.get("checkpointing", False))
        if planned != checkpoint:
            raise ConfigError(
                f"granular_offload.activations.checkpointing is {str(planned).lower()} but {kind}.{CHECKPOINT_KEY} is "
                f"{str(checkpoint).lower()}: the plan would count the activations of a model that "
                f"{'recomputes' if planned else 'keeps'} them, and this one "
                f"{'recomputes' if checkpoint else 'keeps'} them; make the two agree")


def _gpt_spec(section: Dict[str, Any], flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    unknown = sorted(set(section) - set(GPT_KEYS))
    if unknown:
        raise ConfigError(f"gpt: unknown key(s) {unknown}; accepted: {[*GPT_KEYS, CHECKPOINT_KEY]}")
    values = {"n_layer": 8, "d_model": 128, "n_head": 4, "seq_len": DEFAULT_SEQ_LEN, "mlp_ratio": 4}
    values.update(section)
    values.update({k: v for k, v in flags.items() if v is not None and k in values})
    for key, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"gpt.{key}: got {value!r}; expected a positive integer")
    if values["d_model"] % values["n_head"]:
        raise ConfigError(f"gpt.d_model ({values['d_model']}) must be divisible by gpt.n_head ({values['n_head']})")
    return ModelSpec("gpt", values["n_layer"], values["seq_len"], vocab_size, options=values)


def _m6_spec(section: Dict[str, Any], flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    run = {key: section.pop(key, default) for key, default in M6_RUN_KEYS.items()}
    if flags.get("seq_len") is not None:
        section["seq_length"] = flags["seq_len"]
    if "vocab_size" in section and section["vocab_size"] < vocab_size:
        raise ConfigError(f"m6.vocab_size: got {section['vocab_size']}; the data's tokenizer has {vocab_size} tokens")
    preset = PRESETS.get(section["preset"]) if isinstance(section.get("preset"), str) else None
    replaced = preset.vocab_size if preset and "vocab_size" not in section and preset.vocab_size != vocab_size \
        else None
    section.setdefault("vocab_size", vocab_size)
    try:
        arch = architecture_from_dict(section)
    except TypeError as error:  # a field missing without a preset
        raise ConfigError(f"m6: {error}; give a preset ({'m6-tiny', 'm6-1t-like', 'm6-10t'}) or every field") from None
    ep = run["expert_parallel"]
    if ep is None:
        ep = math.gcd(world_size, arch.num_experts)
    elif not isinstance(ep, int) or ep < 1 or arch.num_experts % ep or world_size % ep:
        accepted = [k for k in range(1, world_size + 1) if world_size % k == 0 and arch.num_experts % k == 0]
        raise ConfigError(f"m6.expert_parallel: got {ep!r}; it must divide both the {arch.num_experts} experts and "
                          f"the {world_size} ranks (accepted: {accepted})")
    return ModelSpec("m6", arch.num_layers, arch.seq_length, arch.vocab_size,
                     options={"preset": arch.name, "expert_parallel": ep, "capacity_factor": run["capacity_factor"],
                              "balance_coeff": run["balance_coeff"], "arch": arch}, preset_vocab_size=replaced)


def _hf_spec(section: Dict[str, Any], flags, vocab_size: int, world_size: int, eod: Optional[int]) -> ModelSpec:
    unknown = sorted(set(section) - {"config", "layers"})
    if unknown or "config" not in section:
        raise ConfigError(f"hf: got keys {sorted(section)}; expected 'config' (a dict for transformers.AutoConfig."
                          f"for_model, with model_type, or a local folder) and optional 'layers' and "
                          f"'{CHECKPOINT_KEY}'")
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf: needs Hugging Face transformers: pip install 'ds_pseudo_real[hf]'") from None
    raw = section["config"]
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
    layers = section.get("layers") or HF_LAYER_LISTS.get(config.model_type)
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


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if spec.kind == "gpt":
        o = spec.options
        return GPT(GPTConfig(vocab_size=spec.vocab_size, seq_len=spec.seq_len, n_layer=o["n_layer"],
                             d_model=o["d_model"], n_head=o["n_head"], mlp_ratio=o["mlp_ratio"],
                             checkpoint_activations=o[CHECKPOINT_KEY]))
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


def parameter_groups(spec: ModelSpec) -> Optional[Callable[[nn.Module], List[Dict]]]:
    """The ``model_parameters`` callable ``ds_pseudo_real.initialize`` needs for this model (experts apart for M6)."""
    if spec.kind == "m6":
        from .m6 import moe_param_groups

        return moe_param_groups
    return None
