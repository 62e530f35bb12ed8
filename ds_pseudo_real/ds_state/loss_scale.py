"""The fp16 loss scaler's state: read from one engine and written into another (the delink), or from a saved
checkpoint's optimizer state (the offline conversion).

Written against DeepSpeed 0.19.8: ZeRO 1/2 (``DeepSpeedZeroOptimizer``) and ZeRO 3 keep a ``loss_scaler`` (a
``DynamicLossScaler`` with fp16 ``loss_scale: 0``, else a static ``LossScaler``); the stage-0 mixed-precision
optimizers (``FP16_UnfusedOptimizer``) a ``loss_scale_config``; bf16's optimizer and a torch optimizer used as given
(fp32 ZeRO 0) none. DeepSpeed saves and loads them with its optimizer state itself; the delink builds a new engine,
whose scaler would start again from ``initial_scale_power``."""
from __future__ import annotations

from typing import Any, Dict, Optional

# What changes as training goes: the scale, the step counter the growth window counts from, the step of the last
# overflow and the overflows left before the scale is halved (``hysteresis``; ZeRO 1-3 only). The rest
# (``scale_window``, ``min_scale``, ``delayed_shift``, ...) is the config's, the same in every engine of the run.
SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
HOLDERS = ("loss_scaler", "loss_scale_config")  # ZeRO 1-3's scaler; the stage-0 fp16 optimizers' config


def _holder(engine) -> Optional[Any]:
    for name in HOLDERS:
        holder = getattr(engine.optimizer, name, None)
        if holder is not None:
            return holder
    return None


def loss_scaler_state(engine) -> Optional[Dict[str, Any]]:
    """The training state of ``engine``'s loss scaler (:data:`SCALER_STATE`, those its class has), or None where its
    optimizer has none."""
    holder = _holder(engine)
    if holder is None:
        return None
    return {key: getattr(holder, key) for key in SCALER_STATE if hasattr(holder, key)}


def set_loss_scaler_state(engine, state: Optional[Dict[str, Any]]) -> None:
    """Give ``engine``'s loss scaler the ``state`` another engine of the run had (:func:`loss_scaler_state`)."""
    holder = _holder(engine)
    if holder is None or state is None:
        return
    for key, value in state.items():
        if hasattr(holder, key):
            setattr(holder, key, value)


def saved_loss_scaler_state(optimizer_state: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The scaler's state as a DeepSpeed checkpoint saved it, from one rank's optimizer state dict: ZeRO 1-3's
    ``optimizer_state_dict`` (its ``loss_scaler`` object, the same on every rank) or the stage-0 fp16 optimizer's
    ``optimizer`` entry of the model states (its scale fields). None without a scaler (bf16, fp32 ZeRO 0)."""
    if not isinstance(optimizer_state, dict):
        return None
    scaler = optimizer_state.get("loss_scaler")
    holder = vars(scaler) if scaler is not None else optimizer_state
    state = {key: holder[key] for key in SCALER_STATE if key in holder}
    return state or None


def current_loss_scale(engine) -> float:
    """The scale ``engine``'s loss is multiplied by now (1.0 where its optimizer has no scaler: fp32, bf16)."""
    holder = _holder(engine)
    return float(getattr(holder, "cur_scale", 1.0)) if holder is not None else 1.0


def may_skip_steps(engine) -> bool:
    """Whether ``engine``'s optimizer skips a step for an inf or NaN gradient even without gradient clipping: fp16,
    and bf16 with ``bf16.check_grad_overflow`` (DeepSpeed 0.19.8 ZeRO 1/2 ``check_grad_overflow``; with clipping
    on, every dtype skips for an inf or NaN norm)."""
    return bool(getattr(engine.optimizer, "check_grad_overflow", engine.fp16_enabled()))
