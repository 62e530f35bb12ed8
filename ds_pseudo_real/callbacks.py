"""The callback protocol of the engine-owning controller, after Hugging Face's ``TrainerCallback``.

Owns: the training state and control dataclasses, the callback base class and the run state the controller shares
with its checkpoint I/O (``RunState``). Callbacks decide (set flags on ``TrainingControl``); the controller acts.
Nothing here touches DeepSpeed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

PSEUDO = "pseudo"
REAL = "real"


@dataclass
class TrainingState:
    """What the controller knows about the run; saved in every checkpoint."""

    global_step: int = 0
    tokens_seen: int = 0
    stage: str = PSEUDO
    switch_step: Optional[int] = None
    last_train_loss: Optional[float] = None
    transitions_done: int = 0  # of a progressive schedule's transitions (a plain delink: 0, then 1)
    groups: Optional[int] = None  # parameter sets of the layer list now
    # the trigger fired at a step DeepSpeed skipped (inf or NaN gradients: an fp16 overflow): the delink waits for
    # the next step it applies
    delink_pending: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainingState":
        return cls(**data)


@dataclass
class TrainingControl:
    """Flags a callback raises for the controller to act on at the next step boundary."""

    should_delink: bool = False


class TrainingCallback:
    """Override any hook; each gets the live state and control. ``state_dict`` goes into checkpoints."""

    def on_train_begin(self, state: TrainingState, control: TrainingControl) -> None: ...

    def on_step_end(self, state: TrainingState, control: TrainingControl) -> None: ...

    def on_evaluate(self, state: TrainingState, control: TrainingControl, metrics: Dict[str, float]) -> None: ...

    def on_delink(self, state: TrainingState, report: Dict[str, Any]) -> None: ...

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


@dataclass
class CallbackList:
    callbacks: List[TrainingCallback] = field(default_factory=list)

    def fire(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def state_dict(self) -> List[Dict[str, Any]]:
        return [callback.state_dict() for callback in self.callbacks]

    def load_state_dict(self, states: List[Dict[str, Any]]) -> None:
        for callback, state in zip(self.callbacks, states):
            callback.load_state_dict(state)


@dataclass
class RunState:
    """What the controller shares with its checkpoint I/O: the training state (which loading a checkpoint replaces)
    and the callbacks (whose state every checkpoint keeps). The controller owns it."""

    state: TrainingState
    callbacks: CallbackList
