"""Granular offload across the delink: the plan is recomputed for the real model and applied to the rebuilt
engine, the loss stays continuous, and the trajectory does not depend on the plan."""
import math
import sys
from pathlib import Path

import pytest

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.offload.params import in_one_allocation

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import BeforeDelink, config, eval_loss, fixed_batch, tiny_gpt  # noqa: E402


def run(levels_or_budget, stage=1, steps=6, clipping=None, dtype="fp32"):
    cfg = config(stage, dtype, "copy", switch=3)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    if clipping is not None:
        cfg["gradient_clipping"] = clipping
    cfg["granular_offload"] = levels_or_budget
    ref = [None]
    before_delink = BeforeDelink(ref, fixed_batch(99))
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg, callbacks=[before_delink])
    ref[0] = engine
    pseudo_host = host_layout(engine)
    plans, losses, report = [engine.offload_plan], [], None
    for _ in range(steps):
        loss = engine(*fixed_batch(1))
        engine.backward(loss)
        stage = engine.stage
        engine.step()
        losses.append(loss.item())
        if stage == "pseudo" and engine.stage == "real":
            plans.append(engine.offload_plan)
            report = dict(engine.last_transition, pre=before_delink.seen["loss"], post=eval_loss(engine, fixed_batch(99)),
                          host=host_layout(engine), pseudo_host=pseudo_host)
    engine.engine.destroy()
    return plans, losses, report


def host_layout(engine):
    """The engine's host_params layers as its HostParamStore holds them: bytes it copied into allocations of its
    own, and per layer whether the layer's params fill one host allocation, in order (None: no HostParamStore)."""
    store = ds_state.basic_optimizer(engine.engine).host_params
    if store is None:
        return None
    layers = {}
    assert {store.host_tensor(p).dtype for p in store._host} == {next(engine.module.parameters()).dtype}
    for i, layer in enumerate(engine.module.layers):
        params = [p for p in layer.parameters() if p in store._host]
        if params:
            assert all(store.host_tensor(p).data_ptr() == p.data_ptr() for p in params)  # between uses: on the host
            layers[i] = in_one_allocation(params, pinned=False)
    return {"repacked_bytes": store.repacked_bytes, "layers": layers}


@pytest.mark.parametrize("stage", [1, 2])
def test_plan_is_recomputed_at_the_delink_and_losses_match_all_device(stage):
    # A budget that holds the pseudo model on the device but not the real one (measured below).
    plans, losses, report = run({"device_memory": "1MiB", "max_level": "host_optimizer"}, stage)
    pseudo_plan, real_plan = plans
    assert report["pre"] == report["post"]
    assert report["moments_carried"] == len(list(tiny_gpt().parameters()))
    assert report["offload_plan_before"] is pseudo_plan and report["offload_plan_after"] is real_plan
    assert set(pseudo_plan.levels().values()) == {"device"}
    assert "host_optimizer" in real_plan.levels().values()
    assert len(real_plan.placements) == len(pseudo_plan.placements) + 3  # layers 1-3 get their own groups
    assert real_plan.device_bytes <= 1 << 20
    reference_plans, reference, _ = run({"device_memory": "1GiB"}, stage)
    assert all(set(plan.levels().values()) == {"device"} for plan in reference_plans)
    assert losses == reference


def test_host_params_level_after_the_delink_matches_all_device():
    """ZeRO-0 fp32: the real model's plan puts some layers' parameters on the host, fetched per layer."""
    plans, losses, report = run({"device_memory": "520KiB", "max_level": "host_params"}, stage=0)
    assert report["pre"] == report["post"]
    assert set(plans[0].levels().values()) == {"device"}
    assert "host_params" in plans[1].levels().values()
    # the delink built the host_params layers in their host allocations: the store copied nothing
    assert report["host"]["repacked_bytes"] == 0 and report["host"]["layers"]
    assert all(report["host"]["layers"].values())
    _, reference, _ = run({"device_memory": "1GiB"}, stage=0)
    assert losses == reference


@pytest.mark.parametrize("stage", [1, 2])
def test_host_params_outside_deepspeed_across_the_delink(stage):
    """ZeRO 1/2: the pseudo model's shared set and then the real model's layers 2-3 at host_params, stepped by
    the offload optimizer outside DeepSpeed's; the delink carries their moments and the trajectory is the
    all-device one bit for bit (without clipping, whose norm the own groups join in another summation order)."""
    levels = {"levels": ["host_params", "device", "host_params", "host_params"]}
    plans, losses, report = run(levels, stage, clipping=0.0)
    assert report["pre"] == report["post"]
    assert report["moments_carried"] == len(list(tiny_gpt().parameters()))
    assert plans[0].levels()["layer0"] == "host_params"
    assert [plans[1].level_of(f"layer{i}").value for i in range(4)] == ["host_params", "device", "host_params",
                                                                       "host_params"]
    assert report["host"] == {"repacked_bytes": 0, "layers": {0: True, 2: True, 3: True}}
    # the pseudo model the caller built: its shared set copied once into the store's allocation, used by 4 layers
    layer_bytes = 4 * sum(p.numel() for p in tiny_gpt().layers[0].parameters())
    assert report["pseudo_host"] == {"repacked_bytes": layer_bytes, "layers": {0: True, 1: True, 2: True, 3: True}}
    _, reference, _ = run({"device_memory": "1GiB"}, stage, clipping=0.0)
    assert losses == reference
    _, clipped, _ = run(levels, stage)
    _, clipped_reference, _ = run({"device_memory": "1GiB"}, stage)
    assert clipped == pytest.approx(clipped_reference, rel=1e-6)


def test_host_params_layers_are_built_in_place_in_bf16():
    """bf16, ZeRO 2: the delink builds the host_params layers in bf16 in their host allocations, which DeepSpeed's
    cast to bf16 leaves as they are and the store takes without copying."""
    levels = {"levels": ["host_params", "device", "host_params", "host_params"]}
    _, losses, report = run(levels, 2, clipping=0.0, dtype="bf16")
    assert report["host"] == {"repacked_bytes": 0, "layers": {0: True, 2: True, 3: True}}
    assert abs(report["pre"] - report["post"]) <= 2**-7 * abs(report["pre"]) and all(map(math.isfinite, losses))


def test_explicit_levels_name_the_real_models_layers_in_both_stages():
    """One list of levels for all 4 layers: the pseudo model's shared set takes layer 0's level, the real model
    gets each layer's own."""
    plans, losses, report = run({"levels": ["device", "device", "host_optimizer", "host_optimizer"]})
    assert report["pre"] == report["post"]
    assert plans[0].levels() == {"layer0": "device", "other": "device"}
    assert plans[1].levels() == {"layer0": "device", "layer1": "device", "layer2": "host_optimizer",
                                 "layer3": "host_optimizer", "other": "device"}
    _, reference, _ = run({"device_memory": "1GiB"})
    assert losses == reference
