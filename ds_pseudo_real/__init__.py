"""ds_pseudo_real: Pseudo-to-Real (sharing -> delinking) training and granular CPU offload for DeepSpeed.

``initialize`` replaces ``deepspeed.initialize``: the model only has to name its layer list in the config's
``"pseudo_to_real"`` section.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Union

from .callbacks import TrainingCallback, TrainingControl, TrainingState
from .config import ConfigError, PseudoToRealConfig

if TYPE_CHECKING:
    from .run_config import RunConfig
    from .sharing import apply_sharing, delink_layers, parameter_count

__version__ = "0.1.0"


def initialize(
    model,
    config: Union[str, os.PathLike, Mapping[str, Any], RunConfig, None] = None,
    *,
    args=None,
    optimizer: Optional[Callable] = None,
    model_parameters: Optional[Callable] = None,
    lr_scheduler: Optional[Callable] = None,
    training_data=None,
    collate_fn=None,
    mpu=None,
    callbacks: Iterable[TrainingCallback] = (),
):
    """Build the pseudo (or, with ``enabled: false``, the real) model's DeepSpeed engine behind a controller.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like ``deepspeed.initialize``; ``engine``
    is a :class:`~ds_pseudo_real.controller.PseudoToRealController` that swaps its DeepSpeed engine at the delink;
    the optimizer and scheduler returned are views of the controller's current ones (``engine.optimizer``), valid
    on both sides of the switch. ``optimizer``,
    ``model_parameters`` and ``lr_scheduler`` must be callables so they can be rebuilt for the real model.
    ``config`` (a path, a dict or a :class:`RunConfig` already read) may also come from ``args.deepspeed_config``
    (the launcher's ``--deepspeed_config``).
    """
    from .controller import PseudoToRealController
    from .ds_state import announce_op_builds
    from .logs import quiet_libraries
    from .pipeline import model_parallel_unit
    from .run_config import RunConfig

    announce_op_builds()  # DeepSpeed's engine may build a C++ op: say what, and that it happens once
    quiet_libraries()

    if config is None:
        config = getattr(args, "deepspeed_config", None)
        if config is None:
            raise ConfigError("no DeepSpeed config: pass config=... or args with --deepspeed_config")
    config = RunConfig.load(config, mpu=model_parallel_unit(model, mpu))
    engine = PseudoToRealController(
        model,
        config,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        mpu=mpu,
        callbacks=callbacks,
    )
    from .controller import CurrentOf

    optimizer = CurrentOf(engine, "optimizer") if engine.optimizer is not None else None
    scheduler = CurrentOf(engine, "lr_scheduler") if engine.lr_scheduler is not None else None
    return engine, optimizer, engine.training_dataloader, scheduler


def __getattr__(name: str):
    # imported when first asked for, so that ``import ds_pseudo_real`` (every command's first import, ``--help``
    # included) stays free of torch and DeepSpeed: RunConfig reads the granular_offload section, whose package
    # imports DeepSpeed; the sharing functions are torch's
    if name == "RunConfig":
        from .run_config import RunConfig

        return RunConfig
    if name in ("apply_sharing", "delink_layers", "parameter_count"):
        from . import sharing

        return getattr(sharing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "initialize",
    "ConfigError",
    "PseudoToRealConfig",
    "RunConfig",
    "TrainingCallback",
    "TrainingControl",
    "TrainingState",
    "apply_sharing",
    "delink_layers",
    "parameter_count",
]
