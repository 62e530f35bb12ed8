"""What every model section of the main job's config has, validated like the plugin's sections; each family's own
section lives in its module (``models.families``).

Owns: the base section and its shared field helpers. Must not build models, nor check what depends on the data or
the ranks (a family's ``spec`` does).
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import Field

from ..config import SectionModel

DEFAULT_SEQ_LEN = 128
CHECKPOINT_KEY = "checkpoint_activations"  # in every model section: recompute each layer in the backward


def count(default: Optional[int] = None) -> Any:
    """A positive integer key (JSON's ``4``; neither ``4.0``, ``"4"`` nor ``true``)."""
    return Field(default, ge=1, strict=True)


class ModelSection(SectionModel):
    """The keys every model section takes; ``kind`` is the config key that selects the family."""

    kind: ClassVar[str]
    checkpoint_activations: bool = Field(False, strict=True)  # recompute each layer in the backward
