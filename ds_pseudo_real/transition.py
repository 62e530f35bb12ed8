"""When to delink and what the optimizer state becomes: the stage-transition callback and pure policy math.

Owns: the switch trigger (step, tokens, plateau), the per-layer moment mapping for copy/reset/scale and the LR
re-warmup factor. Must not touch engines: the controller applies what these decide.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch

from .callbacks import PSEUDO, TrainingCallback, TrainingControl, TrainingState
from .config import OptimizerStatePolicy, PlateauMetric, SwitchTrigger


def plateaued(values: Sequence[float], window: int, min_improvement: float) -> bool:
    """True when the mean of the last ``window`` values beats the mean of the ``window`` before by < min_improvement."""
    if len(values) < 2 * window:
        return False
    recent = sum(values[-window:]) / window
    before = sum(values[-2 * window : -window]) / window
    return before - recent < min_improvement


class StageTransitionCallback(TrainingCallback):
    """Raises ``control.should_delink`` when the trigger of the next transition fires in the pseudo stage: one
    trigger for a plain delink, one per transition of a progressive schedule (``state.transitions_done`` says which
    is next; a plateau is judged on the values seen since the last transition)."""

    def __init__(self, trigger: Union[SwitchTrigger, Sequence[SwitchTrigger]]):
        self.triggers = [trigger] if isinstance(trigger, SwitchTrigger) else list(trigger)
        self.trigger = self.triggers[0]
        self.history: List[float] = []

    def _current(self, state: TrainingState) -> Optional[SwitchTrigger]:
        if state.stage != PSEUDO or state.transitions_done >= len(self.triggers):
            return None
        self.trigger = self.triggers[state.transitions_done]
        return self.trigger

    def _plateau_fired(self, state: TrainingState) -> bool:
        plateau = self.trigger.on_plateau
        return state.global_step >= plateau.min_steps and plateaued(self.history, plateau.window, plateau.min_improvement)

    def on_delink(self, state: TrainingState, report: Dict) -> None:
        self.history = []

    def on_step_end(self, state: TrainingState, control: TrainingControl) -> None:
        trigger = self._current(state)
        if trigger is None:
            return
        if trigger.at_step is not None:
            control.should_delink = state.global_step >= trigger.at_step
        elif trigger.at_tokens is not None:
            control.should_delink = state.tokens_seen >= trigger.at_tokens
        elif trigger.on_plateau.metric == PlateauMetric.TRAINING.value and state.last_train_loss is not None:
            self.history.append(state.last_train_loss)
            control.should_delink = self._plateau_fired(state)

    def on_evaluate(self, state: TrainingState, control: TrainingControl, metrics: Dict[str, float]) -> None:
        trigger = self._current(state)
        plateau = trigger.on_plateau if trigger is not None else None
        if plateau is None or plateau.metric != PlateauMetric.VALIDATION.value:
            return
        if "val_loss" not in metrics:
            raise KeyError("pseudo_to_real.switch.on_plateau.metric is 'val_loss' but report_eval() got no 'val_loss'")
        self.history.append(float(metrics["val_loss"]))
        control.should_delink = self._plateau_fired(state)

    def state_dict(self) -> Dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Dict) -> None:
        self.history = list(state.get("history", []))


def member_moments(
    policy: str, moments: Dict[str, torch.Tensor], members: int
) -> Optional[Dict[str, torch.Tensor]]:
    """The Adam moments one of ``members`` delinked layers starts with, or None for ``reset``.

    The shared parameter's gradient is the sum of its ``members`` layers' gradients, so its first moment is about
    ``members`` times and its second about ``members**2`` times a single layer's: ``scale`` divides them out.
    """
    if policy == OptimizerStatePolicy.RESET.value:
        return None
    if policy == OptimizerStatePolicy.COPY.value or members == 1:
        return {key: value.clone() for key, value in moments.items()}
    if policy == OptimizerStatePolicy.SCALE.value:
        return {"exp_avg": moments["exp_avg"] / members, "exp_avg_sq": moments["exp_avg_sq"] / members**2}
    raise ValueError(f"pseudo_to_real.optimizer_state: got {policy!r}; accepted: copy, reset, scale")


def rewarmup_factor(steps_since_switch: int, rewarmup_steps: int) -> float:
    """LR multiplier for the ``steps_since_switch``-th optimizer step (0-based) after the delink."""
    if rewarmup_steps <= 0 or steps_since_switch >= rewarmup_steps:
        return 1.0
    return (steps_since_switch + 1) / (rewarmup_steps + 1)


def lr_factor(shared_stage: bool, pseudo_lr_scale: float, steps_since_switch: Optional[int],
              rewarmup_steps: int) -> float:
    """LR multiplier for one optimizer step: ``pseudo_lr_scale`` in a stage before the real model (a shared set's
    update moves every layer it stands for at once), times the re-warmup ramp after a transition
    (``steps_since_switch`` None before the first)."""
    factor = pseudo_lr_scale if shared_stage else 1.0
    if steps_since_switch is not None:
        factor *= rewarmup_factor(steps_since_switch, rewarmup_steps)
    return factor
