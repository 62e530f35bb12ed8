"""The main job's model sections of the config, ``gpt``, ``m6`` or ``hf``, validated like the plugin's sections.

Owns: one pydantic model per section (``run_config`` picks the config's one section). Must not build models, nor
check what depends on the data or the ranks (the vocabulary, ``m6.expert_parallel`` against the world): ``build`` does.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Literal, Optional, Union

from pydantic import Field, field_validator

from ..config import SectionModel
from ..moe.architecture import PRESETS, M6Architecture, architecture_from_dict

DEFAULT_SEQ_LEN = 128
PresetName = Literal[tuple(PRESETS)]


def _count(default: Optional[int] = None) -> Any:
    """A positive integer key (JSON's ``4``; neither ``4.0``, ``"4"`` nor ``true``)."""
    return Field(default, ge=1, strict=True)


class ModelSection(SectionModel):
    """The keys every model section takes."""

    kind: ClassVar[str]
    checkpoint_activations: bool = Field(False, strict=True)  # recompute each layer in the backward


class GPTSection(ModelSection):
    """The byte-level GPT (``models.gpt``); the job's flags ``--n-layer``, ``--d-model``, ``--n-head`` and
    ``--seq-len`` win over it."""

    kind: ClassVar[str] = "gpt"
    n_layer: int = _count(8)
    d_model: int = _count(128)
    n_head: int = _count(4)
    seq_len: int = _count(DEFAULT_SEQ_LEN)
    mlp_ratio: int = _count(4)


class M6Section(ModelSection):
    """The M6 expert-prototyping MoE: a ``preset`` with overrides of its :class:`M6Architecture` fields, or every
    field; and how the job runs it."""

    kind: ClassVar[str] = "m6"
    preset: Optional[PresetName] = None
    name: Optional[str] = None
    num_layers: Optional[int] = _count()
    hidden_size: Optional[int] = _count()
    num_heads: Optional[int] = _count()
    expert_ffn_size: Optional[int] = _count()
    num_experts: Optional[int] = _count()
    num_prototypes: Optional[int] = _count()
    vocab_size: Optional[int] = _count()
    seq_length: Optional[int] = _count()
    expert_parallel: Optional[int] = _count()  # None: the job takes gcd(ranks, experts)
    capacity_factor: float = Field(1.25, gt=0)
    balance_coeff: float = Field(0.01, ge=0)

    def architecture(self, **overrides: Any) -> M6Architecture:
        """The architecture the section describes, with ``overrides`` of its fields (``architecture_from_dict``:
        a ``TypeError`` names a field missing without a preset)."""
        keys = {"preset", *(name for name in M6Architecture.__dataclass_fields__)}
        return architecture_from_dict({**self.model_dump(include=keys, exclude_none=True), **overrides})


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


MODEL_SECTIONS = {section.kind: section for section in (GPTSection, M6Section, HFSection)}

