"""Granular offload's gradients in a built engine's step: in its global norm and overflow check, dropped by its
zero_grad, handed over before its reduction. Wraps one engine's instances, never a class (DeepSpeed 0.19.8)."""
from __future__ import annotations

import math
from typing import Any, Callable, Tuple

import torch
from deepspeed.runtime.utils import combine_grad_norm_groups

from .layout import basic_optimizer


def include_in_gradient_norm(engine, extra_norm: Callable[[bool], torch.Tensor]) -> Callable[[], Tuple[Any, float]]:
    """Make the global gradient norm of ``engine``'s ZeRO 1/2 or bf16 optimizer include ``extra_norm(summed)`` (the
    L2 norm of gradients it does not hold, already reduced over the data-parallel ranks; ``summed``: over the
    model-parallel group too, else this rank's part), so that it clips with the whole model's norm. Returns a
    callable giving the norm of the current step once DeepSpeed computed it.

    DeepSpeed 0.19.8: ZeRO 1/2 combine their group norms in ``scaled_global_norm()`` before clipping; the bf16
    optimizer takes the norm of the tensors ``get_grads_for_norm()`` lists, so a one-element tensor holding the
    extra norm adds its square (it sums the squares over the model-parallel group itself: this rank's part is
    given); the stage-0 unfused optimizer (bf16 or fp16 with a client optimizer) passes its norm to
    ``unscale_and_clip_grads``, after deciding on overflow (its ``overflow_checker``, which an inf or NaN extra norm
    trips too). All skip the step for an inf or NaN extra norm as they do for their own (ZeRO 1/2 in bf16: when
    ``bf16.check_grad_overflow``; in fp16 and fp32 always), on every rank alike: the norm is the same on all of them.

    The returned callable gives ``(norm, loss_scale)`` as the optimizer unscales and clips its own gradients with
    them: the norm of the loss-scaled gradients and the loss scale it divides by. In fp16 the gradients are those of
    the scaled loss; ZeRO 1/2 divide them by the scale as it is after ``_update_scale`` (which doubles it at the end
    of a growth window: that step's gradients are divided by the new scale), and so does the unfused optimizer; the
    bf16 optimizer reports scale 1. ZeRO 1/2 keep the unscaled norm in ``_global_grad_norm``, so the scaled one is
    taken here.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "scaled_global_norm"):
        return _fold_into_zero_norm(optimizer, extra_norm)
    if hasattr(optimizer, "get_grads_for_norm") and hasattr(optimizer, "bf16_groups"):
        return _fold_into_bf16_norm(optimizer, extra_norm)
    if hasattr(optimizer, "unscale_and_clip_grads") and hasattr(optimizer, "fp32_groups"):
        return _fold_into_unfused_norm(optimizer, extra_norm)
    raise TypeError(f"granular_offload: cannot fold gradients into the global norm of {type(optimizer).__name__} "
                    f"(written against DeepSpeed 0.19.8's ZeRO 1/2, bf16 and stage-0 unfused optimizers)")


def _fold_into_zero_norm(optimizer, extra_norm: Callable[[bool], torch.Tensor]) -> Callable[[], Tuple[Any, float]]:
    """ZeRO 1/2: the extra norm combined with the group norms in ``scaled_global_norm()``."""
    original = optimizer.scaled_global_norm
    scaled = {}

    def scaled_global_norm(norm_type=2):
        norm = original(norm_type)
        scaled["norm"] = combine_grad_norm_groups([norm, extra_norm(True).to(norm.device)], norm_type=norm_type)
        return scaled["norm"]

    optimizer.scaled_global_norm = scaled_global_norm
    return lambda: (scaled.get("norm"), optimizer.loss_scale)


def _fold_into_bf16_norm(optimizer, extra_norm: Callable[[bool], torch.Tensor]) -> Callable[[], Tuple[Any, float]]:
    """The bf16 optimizer: a one-element tensor holding this rank's part of the extra norm among the tensors
    ``get_grads_for_norm()`` lists."""
    original = optimizer.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        grads = original(for_clipping=for_clipping)
        if for_clipping:
            return grads
        dense, experts = grads
        device = dense[0].device if dense else torch.device("cpu")
        return dense + [extra_norm(False).to(device).reshape(1)], experts

    optimizer.get_grads_for_norm = get_grads_for_norm
    return lambda: (optimizer._global_grad_norm, 1.0)


def _fold_into_unfused_norm(optimizer, extra_norm: Callable[[bool], torch.Tensor]) -> Callable[[], Tuple[Any, float]]:
    """The stage-0 unfused optimizer (bf16 or fp16 with a client optimizer): it decides on overflow
    (``overflow_checker``) before it takes the norm, so the extra norm, taken once per step, joins that decision
    first, then the norm ``unscale_and_clip_grads`` is given."""
    checker, original_check = optimizer.overflow_checker, optimizer.overflow_checker.check
    original = optimizer.unscale_and_clip_grads
    extra = {}

    def check(*args, **kwargs):
        extra["norm"] = float(extra_norm(True))
        return original_check(*args, **kwargs) or not math.isfinite(extra["norm"])

    def unscale_and_clip_grads(total_norm, apply_scale=True):
        norm = extra.pop("norm") if "norm" in extra else float(extra_norm(True))
        total_norm = float(torch.tensor([total_norm, norm]).norm())
        optimizer._global_grad_norm = total_norm
        return original(total_norm, apply_scale)

    checker.check = check
    optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    return lambda: (optimizer._global_grad_norm, optimizer.loss_scale_config.cur_scale)


def drop_gradients_with(engine, drop: Callable[[], None]) -> None:
    """Make the ``zero_grad`` of ``engine``'s ZeRO 1/2, bf16 or unfused optimizer call ``drop()`` too, for gradients it
    does not hold. DeepSpeed 0.19.8 calls it after every optimizer step, a skipped one (inf or NaN gradients)
    included (``engine._take_model_step``), and ZeRO 1/2 and the unfused optimizer within a skipped step; a client
    optimizer the engine uses as it is (fp32 ZeRO 0) has its own ``zero_grad``."""
    optimizer = engine.optimizer
    if optimizer is basic_optimizer(engine):
        return
    original = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        original(*args, **kwargs)
        drop()

    optimizer.zero_grad = zero_grad


def before_gradient_reduction(engine, prepare: Callable[[], None]) -> None:
    """Make ``engine`` call ``prepare()`` before it all-reduces the gradients of a backward itself (DeepSpeed 0.19.8
    ``allreduce_gradients``, after every backward; at ZeRO 0 it reduces every parameter's gradient)."""
    original = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        prepare()
        return original(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients


def steps_when_built(engine) -> bool:
    """True when the engine's optimizer stepped its client optimizer once with zero gradients while it was built
    (DeepSpeed 0.19.8's stage-0 unfused optimizer, bf16 or fp16: ``initialize_optimizer_states``)."""
    optimizer = engine.optimizer
    return (hasattr(optimizer, "initialize_optimizer_states") and hasattr(optimizer, "fp32_groups")
            and not hasattr(optimizer, "bf16_groups"))
