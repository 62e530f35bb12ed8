"""The model families the main job trains, each registered by a module of its own: the config section that selects
it, how a model is specified from that section (checked against the data and the ranks), built and counted, and its
row of the models table in docs/main-job.md.

Owns: the registry and :class:`ModelSpec`. Must not know any family: the modules of ``models.families`` register
the built-in ones when :func:`families` first runs, and a package adds one by declaring a module in the
``ds_pseudo_real.model_families`` entry-point group (``entry_points={"ds_pseudo_real.model_families": ["mine =
my_package.my_family"]}``) that calls :func:`register`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Type

from .sections import CHECKPOINT_KEY, ModelSection

if TYPE_CHECKING:
    from torch import nn

ENTRY_POINTS = "ds_pseudo_real.model_families"


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


# (section, the job's shape flags, the data's vocabulary size, the data-parallel ranks, the end-of-document id)
SpecOf = Callable[[Any, Mapping[str, Optional[int]], int, int, Optional[int]], ModelSpec]


@dataclass(frozen=True)
class ModelFamily:
    """A model family: ``section`` (its ``kind`` is the config key that selects it), ``spec`` (the section made a
    :class:`ModelSpec`, every problem a ``ConfigError``, nothing built), ``build`` (the model of a spec, seeded),
    ``parameter_total`` (its parameters over all ranks, nothing allocated), ``docs_row`` (``| section | model |``,
    its row in docs/main-job.md) and ``parameter_groups`` (the ``model_parameters`` callable a spec's model needs
    for ``ds_pseudo_real.initialize``, None for one group)."""

    section: Type[ModelSection]
    spec: SpecOf
    build: Callable[[ModelSpec, int], "nn.Module"]
    parameter_total: Callable[[ModelSpec], int]
    docs_row: str
    parameter_groups: Callable[[ModelSpec], Optional[Callable]] = lambda spec: None

    @property
    def kind(self) -> str:
        return self.section.kind


_FAMILIES: Dict[str, ModelFamily] = {}
_discovered = False


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` (a module defining a family calls this at import); a second family of one kind is refused."""
    known = _FAMILIES.get(family.kind)
    if known is not None and known is not family:
        raise ValueError(f"a model family {family.kind!r} is registered already ({known.section.__module__})")
    _FAMILIES[family.kind] = family
    return family


def _discover() -> None:
    """Import the built-in families (every module of ``models.families``) and the entry points' modules, once."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    from importlib.metadata import entry_points

    from . import families as built_in

    for module in pkgutil.iter_modules(built_in.__path__):
        importlib.import_module(f"{built_in.__name__}.{module.name}")
    for point in entry_points(group=ENTRY_POINTS):
        point.load()


def families() -> Dict[str, ModelFamily]:
    """Every registered family by kind, the built-in ones first."""
    _discover()
    return dict(_FAMILIES)


def family(kind: str) -> ModelFamily:
    return families()[kind]


def model_sections() -> Dict[str, Type[ModelSection]]:
    """The config section of every family, by the key that selects it."""
    return {kind: family.section for kind, family in families().items()}


def docs_rows() -> List[str]:
    """The models table's rows, one per family, as docs/main-job.md has them."""
    return [family.docs_row for family in families().values()]
