"""fp16 with loss scaling at ZeRO stage 0 is refused, for what DeepSpeed 0.19.8 does there (measured below): its
``engine.backward`` leaves the loss unscaled while its stage-0 fp16 optimizer divides the gradients by the scale.
The refusal names the keys, the values and what is accepted, wherever the plugin reads a config."""
import sys
from pathlib import Path

import deepspeed
import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.offload import build_offload_optimizer
from ds_pseudo_real.run_config import RunConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import FP16, config, fixed_batch, tiny_gpt  # noqa: E402


def gradients_after_backward(stage):
    """(the fp16 gradients' norm after DeepSpeed's engine.backward, the loss's own gradient norm, the loss scale)
    of the tiny GPT in fp16 with dynamic loss scaling, plain DeepSpeed with torch's SGD."""
    model = tiny_gpt()
    reference = tiny_gpt().half().float()  # the same values as the fp16 model
    loss = reference(*fixed_batch(0))
    loss.backward()
    own = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "contiguous_gradients": False}, "fp16": FP16}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=cfg)
    engine.backward(engine(*fixed_batch(0)))
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:  # ZeRO 1 keeps the reduced gradients in its own buffers
        grads = [g for group in engine.optimizer.averaged_gradients.values() for g in group if g is not None]
    norm = torch.cat([g.float().flatten() for g in grads]).norm().item()
    scale = engine.optimizer.loss_scale
    engine.destroy()
    return norm, own, scale


def test_deepspeed_scales_the_loss_at_zero_1_and_not_at_zero_0(cpu_fp16):
    """The reason for the refusal, measured: at ZeRO 1 the gradients after engine.backward are the loss scale times
    the loss's own; at ZeRO 0 they are the loss's own, which FP16_UnfusedOptimizer.step then divides by the scale
    (unscale_and_clip_grads). When this fails, a DeepSpeed release scales the loss at stage 0 (deepspeedai/DeepSpeed
    pull request 8393): lift ``TrainingFacts.refuse_unscaled_fp16``."""
    norm, own, scale = gradients_after_backward(1)
    assert scale == 2**8 and norm == pytest.approx(scale * own, rel=1e-2)
    norm, own, scale = gradients_after_backward(0)
    assert scale == 2**8 and norm == pytest.approx(own, rel=1e-2)


@pytest.mark.parametrize("loss_scale", [0, 128])
def test_fp16_with_loss_scaling_at_zero_0_is_refused(loss_scale, cpu_fp16):
    cfg = config(0, "fp16", "copy")
    cfg["fp16"] = dict(cfg["fp16"], loss_scale=loss_scale)
    scaling = "dynamic loss scaling" if loss_scale == 0 else "loss_scale 128"
    message = (f"zero_optimization.stage: got 0 with fp16.enabled and {scaling}; DeepSpeed 0.19.8 does not scale "
               f"the loss at stage 0")
    with pytest.raises(ConfigError, match=message) as raised:
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    assert "accepted: zero_optimization.stage 1, 2 or 3 with fp16" in str(raised.value)
    with pytest.raises(ConfigError, match=message):
        RunConfig.load({**cfg, "granular_offload": {"device_memory": "1GB"}}, world_size=8)
    offloaded = {**cfg, "granular_offload": {"levels": {"0": "host_optimizer"}},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=message):  # a script that calls deepspeed.initialize itself
        build_offload_optimizer(tiny_gpt(), offloaded, "layers", 1)


def test_fp16_without_loss_scaling_at_zero_0_and_fp16_at_zero_1_are_accepted(cpu_fp16):
    unscaled = config(0, "fp16", "copy")
    unscaled["fp16"] = dict(unscaled["fp16"], loss_scale=1)
    for cfg in (unscaled, config(1, "fp16", "copy")):
        engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
        loss = engine(*fixed_batch(0))
        engine.backward(loss)
        engine.step()
        assert engine.global_steps == 1 and next(engine.module.parameters()).dtype == torch.float16
        engine.engine.destroy()
