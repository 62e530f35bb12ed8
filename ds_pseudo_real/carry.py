"""What the delink carries from one stage's engine into the next one's: where training stands (step counts, the LR
schedule, each param group's LR, the optimizer's step counters, the fp16 loss scaler) and the Adam moments of each shared parameter,
written into its copies.

Owns: reading that from the old engine before it is released and writing it into the new one. Must not build models
or engines (``stages`` does) nor decide what a copy's moments are (``transition.member_moments`` does); DeepSpeed's
internals stay in ``ds_state``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import ds_state
from .transition import member_moments

ENGINE_STEPS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def copy_lrs(old: List[float], optimizer) -> None:
    """Each param group's LR from ``old`` (one per group, or one for all), as the previous engine had them."""
    groups = optimizer.param_groups
    if len(old) == len(groups):
        values = old
    elif len(set(old)) == 1:
        values = old[:1] * len(groups)
    else:
        raise RuntimeError(
            f"cannot carry per-group learning rates across the delink: {len(old)} groups before, {len(groups)} after"
        )
    for group, lr in zip(groups, values):
        group["lr"] = lr


@dataclass
class EngineProgress:
    """Where an engine's training stands: its step counts (skipped steps included), its LR scheduler's state, each
    param group's LR, its optimizer's step counters (in whatever form its class keeps them, ``ds_state.step_counters``)
    and its loss scaler's state (fp16's dynamic scale, its growth window and hysteresis; None without a scaler)."""

    steps: Dict[str, int]
    scheduler_state: Optional[Dict[str, Any]]
    lrs: List[float]
    counters: Dict[str, Any]
    loss_scale: Optional[Dict[str, Any]] = None

    @classmethod
    def of(cls, engine) -> "EngineProgress":
        return cls(steps={key: getattr(engine, key) for key in ENGINE_STEPS},
                   scheduler_state=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                   lrs=[group["lr"] for group in engine.optimizer.param_groups],
                   counters=ds_state.step_counters(engine), loss_scale=ds_state.loss_scaler_state(engine))

    def give_to(self, engine) -> None:
        """The step counts, the LR schedule, the LRs and the loss scale go on in ``engine`` (the optimizer's step
        counters go with the moments, :func:`carry_moments`)."""
        for key, value in self.steps.items():
            setattr(engine, key, value)
        if self.scheduler_state is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(self.scheduler_state)
        copy_lrs(self.lrs, engine.optimizer)
        ds_state.set_loss_scaler_state(engine, self.loss_scale)


def carry_moments(engine, moments: Dict[str, Dict[str, torch.Tensor]], counters: Dict[str, Any], policy: str,
                  source_of: Callable[[str], Tuple[str, int]]) -> int:
    """Write each gathered shared parameter's Adam moments (``moments``, by its name; emptied as they are written),
    as ``policy`` makes them, into its copies in ``engine`` (one shared parameter at a time), zero what has no
    source, and set the step ``counters``; ``source_of`` names the shared parameter a parameter of the engine's
    module (by its name there) starts from and how many sets split it. Returns the number of parameters given
    moments."""
    carried = 0
    unwritten = ds_state.seed_optimizer_state(engine, counters)
    copies: Dict[str, Tuple[int, List[nn.Parameter]]] = {}  # by shared parameter: (members, its copies)
    for name, param in engine.module.named_parameters():
        source, members = source_of(name)
        if source in moments:
            copies.setdefault(source, (members, []))[1].append(param)
    swapped = []  # the copies in sub-groups ZeRO-3 swaps to NVMe, written a sub-group at a time after
    for source, (members, params) in copies.items():  # one shared parameter's moments at a time
        start_moments = member_moments(policy, moments.pop(source), members)
        resident, elsewhere = ds_state.held_in_memory(engine, params)
        ds_state.set_full_moments_of_copies(engine, resident, start_moments, unwritten)
        if elsewhere:
            swapped.append((elsewhere, start_moments))
        carried += len(params)
    unwritten.zero_rest()  # padding, and parameters whose source had no moments
    ds_state.write_swapped_moments(engine, counters, swapped)
    ds_state.replay_cpu_adam_steps(engine)
    return carried
