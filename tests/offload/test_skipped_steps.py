"""Optimizer steps DeepSpeed skips, and gradients it zeroes, under granular offload: the groups the offload
optimizer steps itself (host_params under ZeRO 1/2 or bf16, outside DeepSpeed's optimizer) must skip and drop their
gradients exactly when DeepSpeed does for its own parameters.

What DeepSpeed 0.19.8 does on the CPU with an inf gradient (established below on a run without offload, the same
groups stepped by the same CPU Adam kernel): ZeRO 1/2 (fp32, bf16 and fp16) find the global gradient norm invalid
and skip the step (``engine.skipped_steps``), as does the stage-0 unfused optimizer that bf16 ZeRO 0 uses with a
client optimizer; in fp16 the dynamic loss scaler halves the scale (hysteresis 1 here); fp32 ZeRO 0 checks
nothing and steps with the inf, so every later value is NaN. The offload run must match the run without offload in
each case: losses, weights and the loss scaler's state bit for bit (no clipping), and at a skipped step the offload
optimizer's weights, moments and step counts unchanged and no gradient left pending. DeepSpeed's
optimizer ``zero_grad`` (which the engine calls after every step, skipped or not) drops a backward's gradients
in the run without offload; the offload run must drop them too."""
import os
import sys

import deepspeed
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

sys.path.insert(0, os.path.dirname(__file__))
from run_training import ADAM, ds_config, flat_params, letter_levels, make_model  # noqa: E402
from tiny_model import batch  # noqa: E402

from ds_pseudo_real import ds_state  # noqa: E402
from ds_pseudo_real.offload import (  # noqa: E402
    PlacementLevel, attach_to_engine, build_offload_optimizer, model_groups, param_group,
)

STEPS, SKIPPED = 5, 2
LETTERS = "opdod"  # layer0 host_optimizer, layer1 host_params, layer2 device, layer3 host_optimizer, other device


def build(stage, dtype, offload, inf_in=None, inf_at=None):
    """An engine over TinyLM whose ``inf_in`` gradient gets an inf at step ``inf_at`` (see ``Clock``)."""
    model = make_model(None)
    clock = Clock()
    if inf_in is not None:
        dict(model.named_parameters())[inf_in].register_hook(lambda g: clock.poison(g, inf_at))
    config = ds_config(stage, dtype, clipping=0.0)
    if offload:
        config["granular_offload"] = {"levels": letter_levels(LETTERS, 1)}
        optimizer, config, _ = build_offload_optimizer(model, config, "layers", 1)
    else:  # the same per-layer groups, all on the device, stepped by the same kernel
        config = {k: v for k, v in config.items() if k != "optimizer"}
        config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        groups = [param_group(size, ps, PlacementLevel.DEVICE) for size, ps in zip(*model_groups(model, "layers"))]
        optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **ADAM)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    attach_to_engine(engine)
    return engine, optimizer, clock


class Clock:
    """The step being trained, for the gradient hook that poisons one step."""

    def __init__(self):
        self.step = None

    def poison(self, grad, at):
        if self.step != at:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


def offload_state(optimizer):
    """Every state entry of the offload optimizer (DeepSpeed's groups and its own), tensors copied."""
    groups = optimizer.param_groups + optimizer.own_param_groups
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state_of(p).items()}
            for g in groups for p in g["params"]]


def same_state(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b))


def train(stage, dtype, offload, inf_in):
    engine, optimizer, clock = build(stage, dtype, offload, inf_in, SKIPPED)
    run = {"losses": [], "weights": [], "states": [], "pending": [], "scaler": []}
    for step in range(STEPS):
        clock.step = step
        loss = engine(*batch(step, 0))
        engine.backward(loss)
        engine.step()
        run["losses"].append(loss.item())
        run["weights"].append(flat_params(engine).clone())
        run["scaler"].append(ds_state.loss_scaler_state(engine))
        if offload:
            run["states"].append(offload_state(optimizer))
            own = [p for g in optimizer.own_param_groups for p in g["params"]]
            run["pending"].append(float(optimizer.own_grad_norm()) if own else 0.0)
    run["skipped"] = engine.skipped_steps
    run["own_groups"] = [g["placement"] for g in getattr(optimizer, "own_param_groups", [])]
    engine.destroy()
    if offload:
        optimizer.remove_hooks()
    return run


@pytest.mark.parametrize("stage, dtype, inf_in", [
    (0, "bf16", "layers.1.up.weight"),  # in a host_params group the offload optimizer steps itself
    (0, "bf16", "head.weight"),  # in a group DeepSpeed's optimizer holds
    (1, "fp32", "layers.1.up.weight"),
    (2, "fp32", "layers.1.up.weight"),
    (2, "fp32", "layers.0.up.weight"),  # in a host_optimizer group
    (2, "fp32", "head.weight"),
    (2, "bf16", "layers.1.up.weight"),
    (2, "bf16", "layers.3.down.weight"),
    # fp16 with dynamic loss scaling (ZeRO 1/2: stage 0 is refused, test_refusals.py): an own group (host_params
    # outside DeepSpeed's optimizer), a host_optimizer group, a device group
    (1, "fp16", "layers.1.up.weight"),
    (1, "fp16", "layers.0.up.weight"),
    (2, "fp16", "layers.1.up.weight"),
    (2, "fp16", "layers.2.down.weight"),
])
def test_a_step_deepspeed_skips_is_skipped_by_every_offload_group(stage, dtype, inf_in, request):
    if dtype == "fp16":
        request.getfixturevalue("cpu_fp16")
    reference = train(stage, dtype, False, inf_in)
    assert reference["skipped"] == 1  # what DeepSpeed does for its own parameters
    assert torch.equal(reference["weights"][SKIPPED], reference["weights"][SKIPPED - 1])
    run = train(stage, dtype, True, inf_in)
    assert run["own_groups"] == ["layer1"]
    assert run["skipped"] == 1
    assert torch.equal(run["weights"][SKIPPED], run["weights"][SKIPPED - 1]), "weights moved at a skipped step"
    assert same_state(run["states"][SKIPPED], run["states"][SKIPPED - 1]), "moments or steps moved at a skipped step"
    assert run["pending"][SKIPPED] == 0.0, "the skipped step's gradients are still pending"
    assert run["losses"] == reference["losses"]
    assert all(torch.equal(a, b) for a, b in zip(run["weights"], reference["weights"]))
    assert run["scaler"] == reference["scaler"]
    if dtype == "fp16":  # halved at the skipped step (which would have doubled it: the end of a growth window)
        scales = [state["cur_scale"] for state in run["scaler"]]
        assert scales == [2**8] * SKIPPED + [2**7] * (STEPS - SKIPPED), scales


def test_fp32_zero0_steps_with_the_inf_as_deepspeed_does():
    """fp32 ZeRO 0 has no overflow check in DeepSpeed: the step is taken, the inf makes the weights NaN, and the
    offload run (every group in its optimizer, host_params ones included) is NaN in the same places."""
    reference = train(0, "fp32", False, "layers.1.up.weight")
    run = train(0, "fp32", True, "layers.1.up.weight")
    assert reference["skipped"] == run["skipped"] == 0
    assert run["own_groups"] == []
    for ours, theirs in zip(run["weights"], reference["weights"]):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    assert not reference["weights"][SKIPPED].isfinite().all()
    assert torch.equal(torch.tensor(run["losses"]).isnan(), torch.tensor(reference["losses"]).isnan())


def dropped_then_trained(stage, dtype, offload):
    """Per step: a backward on another batch, DeepSpeed's optimizer ``zero_grad``, then the step's batch."""
    engine, optimizer, _ = build(stage, dtype, offload)
    for step in range(2):
        engine.backward(engine(*batch(100 + step, 0)))
        engine.optimizer.zero_grad()
        engine.backward(engine(*batch(step, 0)))
        engine.step()
    weights = flat_params(engine)
    engine.destroy()
    if offload:
        optimizer.remove_hooks()
    return weights


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "fp32"), (2, "bf16"),
                                          (1, "fp16"), (2, "fp16")])
def test_zero_grad_drops_the_offload_groups_gradients_as_deepspeeds(stage, dtype, request):
    if dtype == "fp16":
        request.getfixturevalue("cpu_fp16")
    reference = dropped_then_trained(stage, dtype, False)
    assert torch.equal(reference, weights_without_the_dropped_backward(stage, dtype))
    assert torch.equal(dropped_then_trained(stage, dtype, True), reference)


def weights_without_the_dropped_backward(stage, dtype):
    engine, _, _ = build(stage, dtype, False)
    for step in range(2):
        engine.backward(engine(*batch(step, 0)))
        engine.step()
    weights = flat_params(engine)
    engine.destroy()
    return weights
