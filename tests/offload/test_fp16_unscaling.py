"""Granular offload in fp16 with dynamic loss scaling, on one rank (ZeRO 1/2): the gradients of the groups the offload
optimizer steps itself (host_params outside DeepSpeed's optimizer) are unscaled once, by the very factor DeepSpeed
multiplies its own gradients by (1 / (loss scale x clipping)), at every step, the steps that grow the scale included. (Losses, weights and
the scaler against plain DeepSpeed, skipped steps and the bytes: test_optimizer.py, test_skipped_steps.py.)"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from run_training import granular  # noqa: E402
from tiny_model import batch  # noqa: E402

from ds_pseudo_real import ds_state  # noqa: E402


def deepspeed_factors(engine):
    """Record the factor DeepSpeed multiplies its own gradients by in each step (its ``unscale_and_clip_grads``, run
    on a probe of ones first)."""
    optimizer, factors = engine.optimizer, []
    original = optimizer.unscale_and_clip_grads

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        probe = torch.ones(1)
        original([probe], total_norm)
        factors.append(float(probe))
        return original(grad_groups_flat, total_norm)

    optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    return factors


@pytest.mark.parametrize("stage", [1, 2])
def test_own_groups_are_unscaled_once_by_deepspeeds_factor(stage, cpu_fp16):
    engine, offload, _ = granular(stage, "fp16", {"0": "device", "1": "host_params", "2": "host_optimizer",
                                                  "other": "device"}, None, 1, clipping=1.0)
    assert [g["placement"] for g in offload.own_param_groups] == ["layer1"]
    theirs = deepspeed_factors(engine)
    ours, own_step = [], offload._own_step

    def recording_own_step(factor):
        if not offload._own_stepped:  # ZeRO 1/2 call step() once per group: the first call steps the own groups
            ours.append(offload._gradient_factor())
        return own_step(factor)

    offload._own_step = recording_own_step
    scales = []
    for step in range(5):
        engine.backward(engine(*batch(step, 0)))
        engine.step()
        scales.append(ds_state.loss_scaler_state(engine)["cur_scale"])
    engine.destroy()
    offload.remove_hooks()
    assert engine.skipped_steps == 0 and scales == [2**8, 2**8, 2**9, 2**9, 2**10]  # grown at steps 3 and 5
    per_step = theirs[:: len(theirs) // 5]  # ZeRO 1/2 unscale group by group: the same factor for each
    assert len(ours) == 5 and ours == pytest.approx(per_step, rel=1e-6)
    # clipped (gradient norm > 1) at steps 1, 2 and 4; at steps 3 and 5, which grow the scale, DeepSpeed divides
    # the gradients (scaled by the scale before) by the new scale and clips with the norm divided by it: half the
    # norm, below 1 here, so those steps are not clipped
    assert [factor * scale for factor, scale in zip(ours, scales)][2::2] == [1.0, 1.0]
    assert all(factor * scale < 1 for factor, scale in zip(ours[:2] + ours[3:4], scales[:2] + scales[3:4]))
