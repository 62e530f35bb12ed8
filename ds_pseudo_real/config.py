"""The ``pseudo_to_real`` and ``checkpoint`` sections of a DeepSpeed JSON config, validated like DeepSpeed's own.

Owns: their pydantic models and the base every section model has, and turning validation failures into one error
that names the key, the value received and what is accepted. Must not read files nor build models or engines:
``run_config`` reads the JSON and puts the sections together.
"""
from __future__ import annotations

import difflib
import inspect
import typing
from enum import Enum
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SECTION = "pseudo_to_real"
CHECKPOINT_SECTION = "checkpoint"  # DeepSpeed's own section; the plugin adds the keys of CheckpointOptions



class ConfigError(ValueError):
    """A bad key or value in one of the plugin's config sections."""


class SectionModel(BaseModel):
    """Base of every plugin section: unknown keys are refused, values are checked on assignment too, and strictly,
    as JSON gives them: ``true`` is no step count, ``"yes"`` no boolean and ``2.0`` no integer (an integer is a
    number). A field of an Enum says ``strict=False``: JSON gives the enum's value, a string."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=True, strict=True)

    @classmethod
    def unknown_key_message(cls) -> str:
        """What an error calls a key this section does not have (a section whose keys depend on its type says so)."""
        return "unknown key"


class OptimizerStatePolicy(str, Enum):
    COPY = "copy"
    RESET = "reset"
    SCALE = "scale"


class PlateauMetric(str, Enum):
    VALIDATION = "val_loss"
    TRAINING = "train_loss"


class PlateauTrigger(SectionModel):
    """Switch when the mean ``metric`` over the last ``window`` values improved by less than ``min_improvement``
    on the mean of the ``window`` values before them."""

    metric: PlateauMetric = Field(PlateauMetric.VALIDATION, strict=False)
    window: int = Field(5, ge=1)
    min_improvement: float = Field(0.01, ge=0.0)
    min_steps: int = Field(0, ge=0)


class SwitchTrigger(SectionModel):
    """Exactly one of: a step, a token count, a plateau of the pseudo loss."""

    at_step: Optional[int] = Field(None, ge=1)
    at_tokens: Optional[int] = Field(None, ge=1)
    on_plateau: Optional[PlateauTrigger] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "SwitchTrigger":
        chosen = [k for k in ("at_step", "at_tokens", "on_plateau") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(f"give exactly one of at_step, at_tokens, on_plateau; got {chosen or 'none'}")
        return self


class ScheduleStage(SectionModel):
    """One stage of a progressive schedule: ``groups`` parameter sets (omitted on the last stage: every layer its
    own, the real model), entered when its trigger fires (none on the first stage). The first stage may instead
    give ``depth``: a shallow model of its first ``depth`` layers, grown to all of them by stacking copies of it."""

    groups: Optional[int] = Field(None, ge=1)
    depth: Optional[int] = Field(None, ge=1)
    at_step: Optional[int] = Field(None, ge=1)
    at_tokens: Optional[int] = Field(None, ge=1)
    on_plateau: Optional[PlateauTrigger] = None

    def trigger(self) -> Optional[SwitchTrigger]:
        chosen = {k: getattr(self, k) for k in ("at_step", "at_tokens", "on_plateau") if getattr(self, k) is not None}
        return SwitchTrigger(**chosen) if chosen else None


class PseudoToRealConfig(SectionModel):
    """Top-level ``"pseudo_to_real"`` section: ``groups`` + ``switch`` (one delink to the real model), or a
    ``schedule`` of stages, each an exact in-process transition from G to G' groups (G' a multiple of G)."""

    enabled: bool = True
    layers: str = Field("layers", min_length=1)
    groups: int = Field(1, ge=1)
    switch: SwitchTrigger = Field(default_factory=lambda: SwitchTrigger(at_step=1000))
    schedule: Optional[List[ScheduleStage]] = None
    optimizer_state: OptimizerStatePolicy = Field(OptimizerStatePolicy.COPY, strict=False)
    rewarmup_steps: int = Field(0, ge=0)
    delink_noise: float = Field(0.0, ge=0.0)
    pseudo_lr_scale: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _schedule_shape(self) -> "PseudoToRealConfig":
        if self.schedule is None:
            return self
        given = sorted({"groups", "switch"} & self.model_fields_set)
        if given:
            raise ValueError(f"give either 'schedule' or {given}, not both (the schedule's first stage has the "
                             f"groups, each later stage its trigger)")
        if len(self.schedule) < 2:
            raise ValueError("schedule: give at least two stages, the first without a trigger")
        first = self.schedule[0]
        if (first.groups is None) == (first.depth is None) or first.trigger() is not None:
            raise ValueError("schedule[0]: the first stage gives 'groups' (or 'depth' for a shallow model grown by "
                             "stacking) and no trigger: it is where training starts")
        if first.depth is not None and (len(self.schedule) != 2 or self.schedule[1].groups is not None):
            raise ValueError("schedule: a shallow first stage ('depth') grows into the real model: give one more "
                             "stage, with its trigger and without 'groups'")
        steps = []
        for index, stage in enumerate(self.schedule[1:], 1):
            if stage.depth is not None:
                raise ValueError(f"schedule[{index}].depth: only the first stage may be shallow")
            trigger = [k for k in ("at_step", "at_tokens", "on_plateau") if getattr(stage, k) is not None]
            if len(trigger) != 1:
                raise ValueError(f"schedule[{index}]: give exactly one of at_step, at_tokens, on_plateau; got "
                                 f"{trigger or 'none'}")
            if stage.groups is None and index != len(self.schedule) - 1:
                raise ValueError(f"schedule[{index}]: only the last stage may omit 'groups' (the real model)")
            if stage.at_step is not None:
                steps.append((index, stage.at_step))
        for (_, before), (index, step) in zip(steps, steps[1:]):
            if step <= before:
                raise ValueError(f"schedule[{index}].at_step: got {step}; it must come after the previous stage's "
                                 f"{before}")
        return self

    def stages(self, num_layers: int) -> List[Tuple[int, int]]:
        """(layers, parameter groups) of every stage, the last one the real model's (``num_layers`` twice)."""
        groups = self.stage_groups(num_layers)
        depth = self.schedule[0].depth if self.schedule is not None else None
        if depth is None:
            return [(num_layers, g) for g in groups]
        if depth >= num_layers or num_layers % depth:
            raise ConfigError(f"pseudo_to_real.schedule[0].depth: got {depth}; a shallow model grows by stacking "
                              f"copies of itself, so it must divide the number of layers ({num_layers}) and be "
                              f"smaller: accepted values "
                              f"{[d for d in range(1, num_layers) if num_layers % d == 0]}")
        return [(depth, depth), (num_layers, num_layers)]

    def stage_groups(self, num_layers: int) -> List[int]:
        """The group count of every stage, the last one ``num_layers`` (the real model); checks that each divides
        the layer count and is a multiple of the one before."""
        if self.schedule is not None and self.schedule[0].depth is not None:
            return [self.schedule[0].depth, num_layers]
        if self.schedule is None:
            stages = [self.groups, num_layers]
            names = ["pseudo_to_real.groups"]
        else:
            stages = [stage.groups or num_layers for stage in self.schedule]
            names = [f"pseudo_to_real.schedule[{i}].groups" for i in range(len(stages))]
        for name, groups in zip(names, stages):
            if num_layers % groups:
                raise ConfigError(f"{name}: got {groups}; it must be >= 1 and divide the number of layers "
                                  f"({num_layers}); accepted values: "
                                  f"{[g for g in range(1, num_layers + 1) if num_layers % g == 0]}")
        for index, (before, after) in enumerate(zip(stages, stages[1:]), 1):
            if self.schedule is not None and (after <= before or after % before):
                raise ConfigError(f"{names[index]}: got {after}; each stage's groups must be a "
                                  f"larger multiple of the previous stage's ({before}): a transition splits every "
                                  f"group into equal runs of consecutive layers")
        return stages

    @property
    def triggers(self) -> List[SwitchTrigger]:
        """The trigger of every transition, in order."""
        if self.schedule is None:
            return [self.switch]
        return [stage.trigger() for stage in self.schedule[1:]]


class CheckpointOptions(SectionModel):
    """The plugin's keys in DeepSpeed's ``checkpoint`` section (DeepSpeed's own keys there pass through to it)."""

    verify: Literal["checksum", "size", "none"] = "checksum"
    keep_last: Optional[int] = Field(None, ge=1)
    async_save: bool = False


def split_checkpoint_options(ds_config: Mapping[str, Any]) -> Tuple[Dict[str, Any], CheckpointOptions]:
    """(the DeepSpeed config without the plugin's checkpoint keys, those keys validated)."""
    section = ds_config.get(CHECKPOINT_SECTION)
    if section is None:
        return dict(ds_config), CheckpointOptions()
    if not isinstance(section, Mapping):
        raise ConfigError(f"invalid config:\n  {CHECKPOINT_SECTION}: expected an object, got {section!r}")
    ours = {k: v for k, v in section.items() if k in CheckpointOptions.model_fields}
    options = validate_section(CheckpointOptions, CHECKPOINT_SECTION, ours)
    # DeepSpeed's other checkpoint engines write the files themselves: its fast writer (checkpoint.writer) and the
    # decoupled engine (writer.decoupled, a writer process fed the live tensors, which the next optimizer step waits
    # for) would bypass the snapshot, the checksums and the fsync that async_save's publication relies on.
    datastates = ds_config.get("datastates_ckpt")
    others = [f"{key} ({value!r})" for key, value in (
        ("checkpoint.writer", section.get("writer")),
        ("datastates_ckpt.enabled", datastates.get("enabled") if isinstance(datastates, Mapping) else None)) if value]
    if options.async_save and others:
        raise ConfigError(f"invalid config:\n  {CHECKPOINT_SECTION}.async_save: true cannot be combined with "
                          f"{' and '.join(others)}, which make DeepSpeed write the files with another checkpoint "
                          f"engine: drop {'them' if len(others) > 1 else 'it'}, or set async_save to false")
    rest = dict(ds_config)
    rest[CHECKPOINT_SECTION] = {k: v for k, v in section.items() if k not in CheckpointOptions.model_fields}
    return rest, options


def format_validation_error(section: str, error: ValidationError, unknown_key: str = "unknown key",
                            model: Optional[type] = None) -> str:
    """One line per problem: ``section.key: message (got value)``; ``unknown_key`` names a key the section itself
    does not have, and an unknown key at any depth gets the closest key of ``model`` (the section's pydantic model)
    at that place, dotted: ``did you mean 'pseudo_to_real.switch.at_step'?``."""
    lines = []
    for item in error.errors():
        where = ".".join([section] + [str(p) for p in item["loc"]])
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = unknown_key if len(item["loc"]) == 1 else "unknown key"
        value = item.get("input")
        line = f"{where}: {message} (got {value!r})"
        if item["type"] == "extra_forbidden" and model is not None:
            known = model_keys(model, item["loc"][:-1])
            line += closest_key(item["loc"], known, section) or (
                f"; accepted keys: {known}" if known and "accepted" not in message else "")
        lines.append(line)
    return "invalid config:\n  " + "\n  ".join(lines)


def model_keys(model: type, path: Sequence[Any]) -> List[str]:
    """The keys the pydantic model nested in ``model`` at ``path`` (keys and list indices of an error's location)
    takes, aliases included; [] where the path leads to no model."""
    for part in path:
        if isinstance(part, int):  # an item of a list: the list's item model
            continue
        fields = getattr(model, "model_fields", {})
        field = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        model = None if field is None else _model_in(field.annotation)
        if model is None:
            return []
    fields = getattr(model, "model_fields", {})
    return sorted(set(fields) | {f.alias for f in fields.values() if f.alias})


def _model_in(annotation: Any) -> Optional[type]:
    """The pydantic model an annotation holds (``Optional[M]``, ``List[M]``, ``Union[..., M]``), if any."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def closest_key(loc: Sequence[Any], known: Iterable[str], section: str) -> str:
    """``; did you mean 'section.path.key'?`` for the last key of ``loc`` among ``known`` (the keys at its place);
    "" when none is close."""
    close = difflib.get_close_matches(str(loc[-1]), sorted(known), n=1, cutoff=0.6)
    dotted = ".".join([section] * bool(section) + [str(p) for p in loc[:-1]] + close[:1])
    return f"; did you mean '{dotted}'?" if close else ""


def validate_section(model: type, section: str, raw: Any) -> Any:
    """Validate one section's dict into ``model``, raising :class:`ConfigError` on any problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"invalid config:\n  {section}: expected an object, got {raw!r}")
    try:
        return model.model_validate(dict(raw))
    except ValidationError as error:
        raise ConfigError(format_validation_error(section, error, model.unknown_key_message(), model)) from None


def optional_section(model: type, section: str, ds_config: Mapping[str, Any]) -> Any:
    """The validated section, or None when the config has none or its ``enabled`` is false."""
    if section not in ds_config:
        return None
    validated = validate_section(model, section, ds_config[section])
    return validated if validated.enabled else None


def parse_pseudo_to_real(ds_config: Mapping[str, Any]) -> PseudoToRealConfig:
    """The validated ``pseudo_to_real`` section (defaults with ``enabled: false`` when the section is absent)."""
    if SECTION not in ds_config:
        return PseudoToRealConfig(enabled=False)
    return validate_section(PseudoToRealConfig, SECTION, ds_config[SECTION])
