"""The byte-level GPT (``models.gpt``): the ``gpt`` section, or none, and the job's shape flags."""
from __future__ import annotations

from typing import ClassVar, Mapping, Optional

import torch

from ...config import ConfigError
from ..gpt import GPT, GPTConfig
from ..registry import ModelFamily, ModelSpec, register
from ..sections import CHECKPOINT_KEY, DEFAULT_SEQ_LEN, ModelSection, count


class GPTSection(ModelSection):
    """The byte-level GPT (``models.gpt``); the job's flags ``--n-layer``, ``--d-model``, ``--n-head`` and
    ``--seq-len`` win over it."""

    kind: ClassVar[str] = "gpt"
    n_layer: int = count(8)
    d_model: int = count(128)
    n_head: int = count(4)
    seq_len: int = count(DEFAULT_SEQ_LEN)
    mlp_ratio: int = count(4)


def gpt_spec(section: GPTSection, flags: Mapping[str, Optional[int]], vocab_size: int, world_size: int,
             eod: Optional[int]) -> ModelSpec:
    values = section.model_dump(exclude={CHECKPOINT_KEY})
    values.update({k: v for k, v in flags.items() if v is not None and k in values})
    if values["d_model"] % values["n_head"]:
        raise ConfigError(f"gpt.d_model ({values['d_model']}) must be divisible by gpt.n_head ({values['n_head']})")
    return ModelSpec("gpt", values["n_layer"], values["seq_len"], vocab_size, options=values)


def gpt_config(spec: ModelSpec) -> GPTConfig:
    o = spec.options
    return GPTConfig(vocab_size=spec.vocab_size, seq_len=spec.seq_len, n_layer=o["n_layer"], d_model=o["d_model"],
                     n_head=o["n_head"], mlp_ratio=o["mlp_ratio"], checkpoint_activations=o[CHECKPOINT_KEY])


def build_gpt(spec: ModelSpec, seed: int) -> torch.nn.Module:
    return GPT(gpt_config(spec))


FAMILY = register(ModelFamily(
    section=GPTSection, spec=gpt_spec, build=build_gpt,
    parameter_total=lambda spec: gpt_config(spec).parameter_count(),
    docs_row='| none, or `"gpt": {"n_layer", "d_model", "n_head", "seq_len", "mlp_ratio", "checkpoint_activations"}` '
             '| the byte-level GPT of `ds_pseudo_real.models` (flags `--n-layer` etc. override the section) |'))
