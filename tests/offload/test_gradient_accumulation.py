"""Gradient accumulation under granular offload: with 4 micro-batches per step every level gives the weights the
same model gets with every layer on the device (bit for bit: same Adam kernel, no clipping), at ZeRO 0/1/2, moving
the bytes per optimizer step the plan predicts; and 4 micro-batches of 2 differ from one batch of 8 only by the
summation order (the all-device run's own gap)."""
import os
import sys

import deepspeed
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402

BATCH, STEPS = 8, 3


def moved_bytes(optimizer):
    """Bytes the offload has copied between host and device: the optimizer's copies and the parameter fetches."""
    return optimizer.moved_bytes + (optimizer.host_params.fetched_bytes if optimizer.host_params else 0)


def weights_after(stage, level, accumulation):
    torch.manual_seed(0)
    model = TinyLM()
    micro = BATCH // accumulation
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 10**6, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "granular_offload": {"levels": {str(i): level for i in range(4)}}}
    optimizer, patched, plan = build_offload_optimizer(model, cfg, "layers", 1)
    assert plan.setup.gradient_accumulation_steps == accumulation
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    for step in range(STEPS):
        before = moved_bytes(optimizer)
        x, y = batch(step, 0, size=BATCH)
        for m in range(accumulation):
            part = slice(m * micro, (m + 1) * micro)
            engine.backward(engine(x[part], y[part]))
            engine.step()
    assert engine.global_steps == STEPS
    # the last step's copies: fetches in every micro-batch's forward and backward, streamed gradients (ZeRO 1/2)
    # every micro-batch, the rest once
    assert moved_bytes(optimizer) - before == plan.moved_bytes_per_step, level
    # what the host holds, the buffers later micro-batches' streamed gradients land in included
    assert optimizer.held_bytes() == {"device": plan.optimizer_device_bytes, "host": plan.optimizer_host_bytes}
    weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    engine.destroy()
    return weights


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_accumulated_steps_equal_the_all_device_model_at_every_level(stage):
    device = weights_after(stage, "device", 4)
    for level in ("host_optimizer", "host_params"):
        assert torch.equal(weights_after(stage, level, 4), device), level
    one_batch = weights_after(stage, "device", 1)
    assert 0 < (one_batch - device).abs().max().item() < 1e-4  # summation order only


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_own_gradients_norm_is_the_host_buffers_norm(dtype, accumulation):
    """The norm of the offload's own gradients (host_params at ZeRO 2) is the norm of what their host buffers hold,
    bit for bit: taken from each gradient before its copy when one flush fills the buffer, read from the buffer
    when micro-batches are added in it."""
    torch.manual_seed(0)
    model = TinyLM()
    cfg = {"train_micro_batch_size_per_gpu": BATCH // accumulation, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 10**6, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "granular_offload": {"levels": {str(i): "host_params" for i in range(4)}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    optimizer, patched, _ = build_offload_optimizer(model, cfg, "layers", 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    own = optimizer.own_gradients
    for step in range(2):
        x, y = batch(step, 0, size=BATCH)
        micro = BATCH // accumulation
        for m in range(accumulation):
            engine.backward(engine(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]))
            if m == accumulation - 1:
                taken_before_copies = len(own._squares)
                norm = optimizer.own_grad_norm()
                buffers = [optimizer.host.grad_buffers[p] for p in own.params]
                assert torch.equal(norm, sum(torch.linalg.vector_norm(b).pow(2) for b in buffers).sqrt())
                assert norm > 0
                assert taken_before_copies == (len(buffers) if accumulation == 1 else 0)
            engine.step()
    engine.destroy()
