"""The byte model and the planner, on plain numbers (no torch, no processes)."""
import pytest

from ds_pseudo_real.offload.planner import (
    GroupSize, PlacementLevel as L, PlanError, TrainingSetup, describe_plan, group_bytes, parse_bytes,
    partition_numel, place, plan_placement, uniform_groups,
)

FP32_Z0 = TrainingSetup("fp32", 0, 1)


def test_group_bytes_fp32_zero0_every_level():
    # n=1000: params 4000, grads 4000, moments 8000, no separate master (the optimizer steps the model's params)
    assert group_bytes(1000, L.DEVICE, FP32_Z0) == (16000, 0, 0, 8000, 0)
    # host master 4000 + grad buffer 4000 + moments 8000 on the host; grad D2H 4000 + master H2D 4000 per step
    assert group_bytes(1000, L.HOST_OPTIMIZER, FP32_Z0) == (8000, 16000, 8000, 0, 16000)
    # device keeps only grads; host params (= master) 4000 + grad buffer 4000 + moments 8000;
    # moved: grad 4000 + params fetched for forward and backward 2 * 4000
    assert group_bytes(1000, L.HOST_PARAMS, FP32_Z0) == (4000, 16000, 12000, 0, 16000)
    # a pseudo layer used by 6 layers is fetched 6 times in each direction of the step
    assert group_bytes(1000, L.HOST_PARAMS, FP32_Z0, uses=6).moved_per_step == 4000 + 6 * 2 * 4000


def test_partition_follows_deepspeed_padding():
    # ZeRO 1/2 pads each flat group to a multiple of 2 * dp, then splits it dp ways
    assert partition_numel(1001, TrainingSetup("fp32", 2, 4)) == 252
    assert partition_numel(1000, TrainingSetup("fp32", 1, 2)) == 500
    assert partition_numel(1001, TrainingSetup("fp32", 1, 1)) == 1002
    # bf16 at stage 0: DeepSpeed's unfused optimizer keeps one fp32 copy per param, on every rank
    assert partition_numel(1001, TrainingSetup("bf16", 0, 2)) == 1001
    assert partition_numel(1001, FP32_Z0) == 1001


def test_group_bytes_bf16_zero2_dp4():
    setup = TrainingSetup("bf16", 2, 4)
    # m=252: params 1001*2, grads 252*2, DeepSpeed fp32 partition 4*252, moments 8*252
    assert group_bytes(1001, L.DEVICE, setup) == (2002 + 504 + 1008 + 2016, 0, 0, 2016, 0)
    assert group_bytes(1001, L.HOST_OPTIMIZER, setup) == (2002 + 504 + 1008, 2 * 1008 + 2016, 2016, 0, 4032)
    # host_params outside DeepSpeed's optimizer, not partitioned: nothing on the device (gradients streamed
    # off); the host holds bf16 params 2002, an fp32 master 4004, a gradient buffer 4004 and moments 8008; per
    # step the fp32 gradient comes out (4004) and the params go in for the forward and the backward (2 * 2002)
    assert group_bytes(1001, L.HOST_PARAMS, setup) == (0, 18018, 8008, 0, 18018)


def test_host_params_outside_deepspeed_at_stage0_keeps_gradients():
    # bf16 ZeRO 0: the engine all-reduces every gradient after the backward, so they stay on the device (2002)
    setup = TrainingSetup("bf16", 0, 2)
    assert setup.host_params_outside_deepspeed and not setup.streams_gradients
    assert group_bytes(1001, L.HOST_PARAMS, setup) == (2002, 18018, 8008, 0, 18018)
    assert not FP32_Z0.host_params_outside_deepspeed


def test_streamed_gradients_take_one_layer_on_the_device():
    groups = [GroupSize(f"layer{i}", 1000, i) for i in range(3)] + [GroupSize("other", 500)]
    zero1 = TrainingSetup("fp32", 1, 1)
    plan = place(groups, {"layer1": L.HOST_PARAMS, "layer2": L.HOST_PARAMS}, zero1)
    assert plan.streamed_gradient_bytes == 4000 and plan.prefetch_buffer_bytes == 8000
    # layer0 and other at the device (ZeRO 1, one rank: params, grads, fp32 partition, moments), plus the buffers
    assert plan.device_bytes == 1000 * 20 + 500 * 20 + 8000 + 4000
    assert place(groups, {"layer1": L.HOST_PARAMS}, FP32_Z0).streamed_gradient_bytes == 0


GROUPS = [GroupSize(f"layer{i}", 1000, i) for i in range(4)] + [GroupSize("other", 500)]


def test_plan_fills_budget_and_offloads_last_layers_first():
    assert place(GROUPS, {}, FP32_Z0).device_bytes == 4 * 16000 + 8000
    plan = plan_placement(GROUPS, FP32_Z0, budget_bytes=50000)
    assert plan.levels() == {"layer0": "device", "layer1": "host_optimizer", "layer2": "host_optimizer",
                             "layer3": "host_optimizer", "other": "device"}
    assert (plan.device_bytes, plan.host_bytes, plan.moved_bytes_per_step) == (48000, 48000, 24000)
    assert (plan.optimizer_device_bytes, plan.optimizer_host_bytes) == (8000 + 4000, 48000)


def test_plan_uses_host_params_when_host_optimizer_is_not_enough():
    # every group at host_optimizer needs 4*8000 + 4000 = 36000; a host_params layer keeps only its grads (4000)
    # but the device holds a prefetch buffer of the two largest host_params layers (8000)
    plan = plan_placement(GROUPS, FP32_Z0, budget_bytes=33000)
    assert plan.levels() == {"layer0": "host_optimizer", "layer1": "host_params", "layer2": "host_params",
                             "layer3": "host_params", "other": "host_optimizer"}
    assert plan.prefetch_buffer_bytes == 8000
    assert plan.device_bytes == 8000 + 3 * 4000 + 8000 + 4000
    assert plan.host_bytes == 4 * 16000 + 8000
    assert plan.moved_bytes_per_step == 8000 + 3 * 12000 + 4000
    plan = plan_placement(GROUPS, FP32_Z0, budget_bytes=31000)
    assert plan.level_of("layer0") is L.HOST_PARAMS and plan.device_bytes == 4 * 4000 + 8000 + 4000


def test_plan_reports_missing_bytes():
    setup = TrainingSetup("fp32", 0, 1, activation_bytes=10000)
    with pytest.raises(PlanError, match=r"device needs .* \(9000 bytes\) missing"):
        # furthest: 4 layers host_params 4*4000 + buffer 8000 + other host_optimizer 4000 + activations 10000 = 38000
        plan_placement(GROUPS, setup, budget_bytes=29000)


def test_experts_are_fetched_with_their_layer():
    # 2 layers of 1000 dense + 1000 expert params, fp32 ZeRO 0: every group at host_params keeps its gradients
    # (4 * 4000) and the buffer holds two layers, dense part and experts together (2 * 4 * 2000): 1 byte short
    groups = uniform_groups(num_layers=2, layer_params=1000, expert_params=1000)
    with pytest.raises(PlanError, match=r"\(1 bytes\) missing") as info:
        plan_placement(groups, FP32_Z0, budget_bytes=31999)
    assert set(info.value.plan.levels().values()) == {"host_params"}
    assert info.value.plan.prefetch_buffer_bytes == 16000
    # at 32000 every group at host_optimizer fits too, moving fewer bytes
    assert set(plan_placement(groups, FP32_Z0, budget_bytes=32000).levels().values()) == {"host_optimizer"}


def test_max_level_and_stage_limit_the_levels():
    with pytest.raises(PlanError, match=r"furthest allowed level \(host_optimizer\)"):
        plan_placement(GROUPS, FP32_Z0, budget_bytes=31000, max_level=L.HOST_OPTIMIZER)
    plan = plan_placement(GROUPS, TrainingSetup("fp32", 1, 1), budget_bytes=10**9)
    assert set(plan.levels().values()) == {"device"}


def test_pseudo_model_plans_the_shared_set_once():
    groups = uniform_groups(num_layers=8, layer_params=1000, other_params=500, shared_groups=2)
    assert [(g.name, g.numel, g.uses) for g in groups] == [("layer0", 1000, 4), ("layer4", 1000, 4), ("other", 500, 1)]
    assert place(groups, {}, FP32_Z0).device_bytes == 2 * 16000 + 8000


def test_parse_bytes_units():
    assert parse_bytes("32GB") == 32 * 10**9
    assert parse_bytes("32GiB") == 32 * 2**30
    assert parse_bytes("1.5 MiB") == 1572864
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError, match="'32 gigs'"):
        parse_bytes("32 gigs")


def test_describe_plan_collapses_runs():
    text = describe_plan(plan_placement(GROUPS, FP32_Z0, budget_bytes=50000))
    assert "layer1..layer3 (3)  host_optimizer  1,000" in text
    assert "groups per level: {'device': 2, 'host_optimizer': 3, 'host_params': 0}" in text


def test_planner_keeps_one_layers_experts_in_deepspeeds_optimizer_outside_fp32_zero0():
    # 4 layers with experts (dense 100, experts 1000 each): under a budget that wants everything on the host,
    # ZeRO 1 keeps one expert group at host_optimizer (DeepSpeed needs an MoE param group); fp32 ZeRO 0 does not
    groups = uniform_groups(4, 100, other_params=50, expert_params=1000)
    zero1 = TrainingSetup("fp32", 1, 1)
    plan = plan_placement(groups, zero1, budget_bytes=26000)
    assert plan.levels() == {**{f"layer{i}": "host_params" for i in range(4)}, "layer0.experts": "host_optimizer",
                             **{f"layer{i}.experts": "host_params" for i in (1, 2, 3)}, "other": "host_optimizer"}
    # the one expert group's params, gradients and fp32 partition (12 B each), other's (12 B each), two layers
    # in the buffer (2 * 4 * 1100) and one layer's streamed gradients (4 * 1100)
    assert plan.device_bytes == 12 * 1000 + 12 * 50 + 8800 + 4400
    with pytest.raises(PlanError, match="every layer's experts at 'host_params'"):
        place(groups, {g.name: L.HOST_PARAMS for g in groups if g.is_layer}, zero1)
    zero0 = place(groups, {g.name: L.HOST_PARAMS for g in groups if g.is_layer}, FP32_Z0)
    # one fetch per layer, dense part and experts together: two layers' worth in the buffer
    assert zero0.prefetch_buffer_bytes == 2 * 4 * 1100
