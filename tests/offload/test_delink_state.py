"""Adam state a delink carries into a granular offload optimizer (``optimizer_state: copy|scale``): created where the
new plan steps it, as a checkpoint load would place it. Host groups' moments on the host (pinned when CUDA is
available), the step count in the type their kernel takes (an int for DeepSpeed's CPU Adam), the CPU Adam kernel's
bias correction carried to the step count, so that the steps after the delink equal those of a run that saved a
checkpoint right after the delink and resumed from it."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.offload import GranularOffloadOptimizer, PlacementLevel

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from delink_matrix import config, fixed_batch, tiny_gpt  # noqa: E402

# Adam's beta2 (0.999) to the power 6 differs in the last bit between the CPU kernel's running product (an
# uninterrupted or resumed run) and its pow() after a jump (a kernel that starts at step 6): delinking after 5
# steps shows a missed carry.
SWITCH, AFTER = 5, 3
LEVELS = ["host_optimizer", "device", "host_optimizer", "host_params"]


def seeded_optimizer(device):
    """A granular optimizer with a host_optimizer group of parameters on ``device`` and a device group on the CPU,
    seeded by the delink's ``seed_optimizer_state`` with a step counter kept as a tensor (torch's Adam), with no
    moments carried into it: what the delink leaves unwritten is zeroed."""
    host_group = [torch.nn.Parameter(torch.zeros(3, 2, device=device)) for _ in range(2)]
    device_group = [torch.nn.Parameter(torch.zeros(4))]
    optimizer = GranularOffloadOptimizer([
        {"params": host_group, "placement": "layer0", "level": PlacementLevel.HOST_OPTIMIZER.value},
        {"params": device_group, "placement": "other", "level": PlacementLevel.DEVICE.value},
    ])
    engine = SimpleNamespace(optimizer=optimizer)  # stage 0 fp32: the engine's optimizer is the client optimizer
    ds_state.seed_optimizer_state(engine, {"state_step": torch.tensor(5.0), "group_steps": [None, None]}).zero_rest()
    return optimizer, host_group, device_group


def test_seeded_host_group_state_is_on_the_host_with_an_int_step():
    """Parameters on a device other than the CPU ('meta' standing in for CUDA): the moments of their
    host_optimizer group are host tensors, not on the parameters' device, and the step an int the CPU kernel takes."""
    optimizer, host_group, device_group = seeded_optimizer("meta")
    for p in host_group + device_group:
        state = optimizer.state[p]
        assert type(state["step"]) is int and state["step"] == 5, state["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device == torch.device("cpu"), (key, state[key].device)
            assert state[key].shape == p.shape and not state[key].any()
            assert state[key].is_pinned() == torch.cuda.is_available()


def delinked(stage, policy):
    cfg = config(stage, "fp32", policy, switch=SWITCH)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    cfg["gradient_clipping"] = 0.0
    cfg["granular_offload"] = {"levels": LEVELS}
    return ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)[0]


def train(engine, first, count):
    losses = []
    for step in range(first, first + count):
        loss = engine(*fixed_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine):
    return torch.cat([ds_state.full_fp32_param(engine.engine, p).flatten() for p in engine.module.parameters()])


def assert_state_placed(engine):
    optimizer = ds_state.basic_optimizer(engine.engine)
    groups = optimizer.param_groups + optimizer.own_param_groups
    assert {g["level"] for g in groups} == {"device", "host_optimizer", "host_params"}
    for group in groups:
        for p in group["params"]:
            state = optimizer.state_of(p)
            on_cuda = group["level"] == PlacementLevel.DEVICE.value and p.is_cuda
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, group["placement"]
            assert (torch.is_tensor(state["step"]) if on_cuda else type(state["step"]) is int), group["placement"]
            for key in ("exp_avg", "exp_avg_sq"):
                tensor = state[key]
                if on_cuda:
                    assert tensor.device == p.device, group["placement"]
                else:
                    assert tensor.device == torch.device("cpu"), group["placement"]
                    assert tensor.is_pinned() == torch.cuda.is_available(), group["placement"]


@pytest.mark.parametrize("stage, policy", [(0, "copy"), (1, "copy"), (2, "copy"), (2, "scale")])
def test_steps_after_the_delink_equal_a_resume_from_a_checkpoint_saved_there(stage, policy, tmp_path):
    engine = delinked(stage, policy)
    train(engine, 0, SWITCH)
    assert engine.stage == "real" and engine.last_transition["moments_carried"] > 0
    assert_state_placed(engine)
    engine.save_checkpoint(str(tmp_path), tag="delinked")
    continued = train(engine, SWITCH, AFTER)
    continued_weights = weights(engine)
    engine.engine.destroy()

    resumed = delinked(stage, policy)
    resumed.load_checkpoint(str(tmp_path), tag="delinked")
    assert resumed.stage == "real"
    assert train(resumed, SWITCH, AFTER) == continued
    assert torch.equal(weights(resumed), continued_weights)
    resumed.engine.destroy()
