"""A Hugging Face ``transformers`` causal LM (an optional extra), built from a local config, never downloaded: the
``hf`` section."""
from __future__ import annotations

import os
from typing import Any, ClassVar, Dict, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from ...config import ConfigError
from ..registry import ModelFamily, ModelSpec, register
from ..sections import CHECKPOINT_KEY, DEFAULT_SEQ_LEN, ModelSection

# Where the layer list of a Hugging Face causal LM lives, by config.model_type (inside the wrapper: "model.").
HF_LAYER_LISTS = {"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}


class HFSection(ModelSection):
    """A Hugging Face causal LM from a local config, never downloaded."""

    kind: ClassVar[str] = "hf"
    config: Union[Dict[str, Any], str]
    layers: Optional[str] = Field(None, min_length=1)

    @field_validator("config", mode="before")
    @classmethod
    def _dict_or_folder(cls, value: Any) -> Any:
        if not isinstance(value, (dict, str)):
            raise ValueError("expected a dict for transformers.AutoConfig.for_model, with model_type, or a local "
                             "folder")
        return value


def hf_spec(section: HFSection, flags: Mapping[str, Optional[int]], vocab_size: int, world_size: int,
            eod: Optional[int]) -> ModelSpec:
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
    return ModelSpec("hf", config.num_hidden_layers, seq_len, config.vocab_size, layers=f"model.{layers}",
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


def build_hf(spec: ModelSpec, seed: int) -> nn.Module:
    model = HFCausalLM(spec.options["hf_config"])
    if spec.options[CHECKPOINT_KEY]:  # the same recompute, through transformers' own switch
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_parameter_total(spec: ModelSpec) -> int:
    """Built on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = build_hf(spec, 0)
    return sum(p.numel() for p in model.parameters())


FAMILY = register(ModelFamily(
    section=HFSection, spec=hf_spec, build=build_hf, parameter_total=hf_parameter_total,
    docs_row='| `"hf": {"config": {"model_type": "gpt2", ...} \\| "local/folder", "layers": "..."}` | a Hugging Face '
             '`transformers` causal LM built from a local config (a dict, or a folder that must exist), never '
             'downloaded (extra `hf`); the layer list is found for GPT-2, Llama and GPT-NeoX, or named with `layers`; '
             'without bos/eos ids in a dict they are the data\'s end-of-document token |'))
