"""The byte model and the planner, on plain numbers (no torch, no processes)."""
import pytest

from ds_pseudo_real.offload.planner import (
    STREAM_POOL_BYTES, GroupSize, HostMemoryError, PlacementLevel as L, PlanError, TrainingSetup, describe_plan,
    group_bytes, host_buffers, parse_bytes, partition_numel, pinned_bytes, place, plan_placement, uniform_groups,
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


def test_pinned_host_buffers_take_whole_pages():
    assert [pinned_bytes(b) for b in (0, 1, 4000, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    pinned = TrainingSetup("bf16", 2, 4, pinned_host=True)
    # host_params outside DeepSpeed: bf16 params 2002 -> one page; fp32 master, gradient buffer and two moments
    # 4004 -> one page each
    assert host_buffers(1001, L.HOST_PARAMS, pinned) == (2002, 4004, 4004, 4004, 4004)
    # host_optimizer: master, gradient buffer and moments of the partition, 4 * 252 = 1008 -> one page each
    assert host_buffers(1001, L.HOST_OPTIMIZER, pinned) == (1008,) * 4
    groups = [GroupSize("layer0", 1001, 0), GroupSize("layer1", 1001, 1), GroupSize("other", 10)]
    plan = place(groups, {"layer0": L.HOST_OPTIMIZER, "layer1": L.HOST_PARAMS}, pinned)
    assert plan.host_bytes == 4 * 1008 + 2002 + 4 * 4004 == 22050
    assert plan.host_allocated_bytes == 9 * 4096 == 36864
    unpinned = place(groups, {"layer0": L.HOST_OPTIMIZER, "layer1": L.HOST_PARAMS}, TrainingSetup("bf16", 2, 4))
    assert unpinned.host_allocated_bytes == unpinned.host_bytes == 22050
    assert "host per rank 36.00 KiB (36864 B): tensors 21.53 KiB, pinned in whole pages +14.47 KiB (+67.18 %)" in \
        describe_plan(plan)


def test_pinned_m6_expert_group_takes_its_tensor_bytes():
    # 20 experts of 2 x 1024 x 9984 per rank; bf16 at host_params outside DeepSpeed: params 2n B, master, gradient
    # buffer and moments 4n B each, every one a whole number of pages already: 18n. torch's pinned allocator would
    # have rounded them to 2**30 and 2**31 (+31.3 %).
    n = 20 * 2 * 1024 * 9984
    setup = TrainingSetup("bf16", 1, 512, pinned_host=True)
    plan = place([GroupSize("layer0.experts", n, 0, dp_size=1), GroupSize("layer1.experts", 1, 1, dp_size=1)],
                 {"layer0.experts": L.HOST_PARAMS}, setup)  # one expert group stays in DeepSpeed's optimizer
    assert (plan.host_bytes, plan.host_allocated_bytes) == (18 * n, 18 * n)
    assert round(100 * ((2**30 + 4 * 2**31) / (18 * n) - 1), 1) == 31.3


def test_reduce_bucket_in_the_backward_flat_gradients_in_the_step():
    # bf16 ZeRO 1 over 2 ranks, everything on the device. A layer of 1001 pads to 1004 (a multiple of 2 * 2), so
    # m = 502: params 2002 + grads 2002 + fp32 partition 4 * 502 + moments 8 * 502 = 10028. other, 500: m = 250,
    # 1000 + 1000 + 1000 + 2000 = 5000
    groups = [GroupSize("layer0", 1001, 0), GroupSize("layer1", 1001, 1), GroupSize("other", 500)]
    assert partition_numel(1001, TrainingSetup("bf16", 1, 2)) == 502
    static = 2 * 10028 + 5000
    # the step flattens one group's bf16 gradient partition (2 * 502) and casts it to fp32 (4 * 502): 3012 B for
    # a layer; the backward holds the activations (100) and the bucket: the peak is the larger
    setup = TrainingSetup("bf16", 1, 2, activation_bytes=100, reduce_bucket_bytes=3000)
    plan = place(groups, {}, setup)
    assert (plan.backward_bytes, plan.flat_gradient_bytes) == (3100, 3012)
    assert plan.device_bytes == static + 3100
    plan = place(groups, {}, TrainingSetup("bf16", 1, 2, activation_bytes=100, reduce_bucket_bytes=1000))
    assert plan.device_bytes == static + 3012
    # layers at host_params are outside DeepSpeed's groups: the largest flattened is other's (6 * 250)
    plan = place(groups, {"layer0": L.HOST_PARAMS, "layer1": L.HOST_PARAMS}, TrainingSetup("bf16", 1, 2))
    assert plan.flat_gradient_bytes == 1500
    # fp32: the flat partition is already fp32 (no copy); ZeRO 0 flattens nothing in the step
    assert place(groups, {}, TrainingSetup("fp32", 2, 2)).flat_gradient_bytes == 4 * 502
    assert place(groups, {}, TrainingSetup("bf16", 0, 2)).flat_gradient_bytes == 0


def test_one_allocator_pool_per_side_stream():
    setup = TrainingSetup("fp32", 0, 1, stream_pool_bytes=STREAM_POOL_BYTES)
    assert STREAM_POOL_BYTES == (2 + 20) * 2**20  # a small and a large segment of the CUDA caching allocator
    resident = place(GROUPS, {}, setup)
    assert (resident.side_streams, resident.device_bytes) == (0, 4 * 16000 + 8000)
    copies = place(GROUPS, {"layer3": L.HOST_OPTIMIZER}, setup)  # the host optimizer's copies
    assert (copies.side_streams, copies.device_bytes) == (1, 3 * 16000 + 8000 + 8000 + STREAM_POOL_BYTES)
    # and the fetches: layer3's gradients (4000) and a buffer of one layer (4000) on the device
    fetches = place(GROUPS, {"layer3": L.HOST_PARAMS}, setup)
    assert (fetches.side_streams, fetches.device_bytes) == (2, 3 * 16000 + 8000 + 4000 + 4000 + 2 * STREAM_POOL_BYTES)


def test_a_placement_above_host_memory_is_refused_naming_the_key():
    # layer3 at host_optimizer, fp32 ZeRO 0: master, gradient buffer and moments of 4000 B, pinned one page each
    pinned = TrainingSetup("fp32", 0, 1, pinned_host=True, host_memory_bytes=16000)
    with pytest.raises(HostMemoryError) as info:
        place(GROUPS, {"layer3": L.HOST_OPTIMIZER}, pinned)
    assert str(info.value) == (
        "granular_offload.host_memory: the placement needs 16.00 KiB (16384 bytes) of host memory per rank (pinned: "
        "each buffer in whole pages), above host_memory 15.62 KiB (16000 bytes); accepted: a placement within it: "
        "fewer groups off the device (a larger device_memory, or levels nearer the device), more data-parallel "
        "ranks, a larger host_memory")
    assert info.value.plan.host_allocated_bytes == 16384
    unpinned = TrainingSetup("fp32", 0, 1, host_memory_bytes=16000)
    assert place(GROUPS, {"layer3": L.HOST_OPTIMIZER}, unpinned).host_allocated_bytes == 16000


def test_planner_stays_within_host_memory_or_says_which_limit_stops_it():
    # all on the device 4 * 16000 + 8000 = 72000; a budget of 60000 needs two groups at host_optimizer (8000 freed
    # by a layer, 4000 by other); each layer takes 4 pinned pages of 4096 bytes, other 4 too
    setup = TrainingSetup("fp32", 0, 1, pinned_host=True, host_memory_bytes=40000)
    plan = plan_placement(GROUPS, setup, budget_bytes=60000, max_level=L.HOST_OPTIMIZER)
    assert plan.levels() == {"layer0": "device", "layer1": "device", "layer2": "host_optimizer",
                             "layer3": "host_optimizer", "other": "device"}
    assert (plan.device_bytes, plan.host_allocated_bytes) == (56000, 32768)
    # 20000: after layer3 (16384), a second layer or other would need 16384 more
    with pytest.raises(HostMemoryError) as info:
        plan_placement(GROUPS, TrainingSetup("fp32", 0, 1, pinned_host=True, host_memory_bytes=20000),
                       budget_bytes=60000, max_level=L.HOST_OPTIMIZER)
    assert ("nothing fits both the device budget of 58.59 KiB and host_memory 19.53 KiB (20000 bytes) per rank: "
            "the furthest placement within host_memory needs 62.50 KiB on the device, 3.91 KiB (4000 bytes) missing, "
            "and offloading one more group needs at least 32.00 KiB (32768 bytes) of host memory") in str(info.value)
    assert info.value.plan.levels()["layer3"] == "host_optimizer"


def test_modelled_step_time_from_pcie_and_cpu_adam():
    # fp32 ZeRO 0, layer2 at host_optimizer (gradient out 4000 + master in 4000, 1000 params stepped on the host),
    # layer3 at host_params (gradient out 4000 + params in for the forward and the backward 2 * 4000, 1000 params)
    setup = TrainingSetup("fp32", 0, 1, pcie_bytes_per_s=1e4, cpu_adam_params_per_s=500)
    plan = place(GROUPS, {"layer2": L.HOST_OPTIMIZER, "layer3": L.HOST_PARAMS}, setup)
    assert (plan.moved_bytes_per_step, plan.host_stepped_numel) == (20000, 2000)
    assert (plan.transfer_seconds, plan.host_adam_seconds, plan.offload_seconds_per_step) == (2.0, 4.0, 6.0)
    assert ("modelled offload time per optimizer step 6 s = PCIe 2 s (at 1e-05 GB/s) + host Adam 4 s (2,000 params "
            "at 500/s)") in describe_plan(plan)
    # ZeRO 2 over 4 ranks: the host steps its partition (252 of 1001) at host_optimizer, all 1001 outside DeepSpeed
    zero2 = TrainingSetup("bf16", 2, 4, cpu_adam_params_per_s=1e3)
    groups = [GroupSize("layer0", 1001, 0), GroupSize("layer1", 1001, 1), GroupSize("other", 10)]
    plan = place(groups, {"layer0": L.HOST_OPTIMIZER, "layer1": L.HOST_PARAMS}, zero2)
    assert plan.host_stepped_numel == 252 + 1001 and plan.host_adam_seconds == pytest.approx(1.253)
    with pytest.raises(PlanError, match=r"granular_offload.pcie_gb_per_s: got 0.0, accepted: a number > 0"):
        TrainingSetup(pcie_bytes_per_s=0)


def test_gradient_accumulation_fetches_every_micro_batch_and_steps_once():
    # fp32 ZeRO 0, 1000 params a layer, layer2 at host_optimizer and layer3 at host_params. Per optimizer step of GA
    # micro-batches: layer2's gradient out (4000) and master in (4000) once; layer3's gradient, accumulated on the
    # device until the step, out once (4000), and its params in for every micro-batch's forward and backward
    # (GA x 2 x 4000). The host Adam steps both layers (2000 params) once per optimizer step, whatever GA.
    levels = {"layer2": L.HOST_OPTIMIZER, "layer3": L.HOST_PARAMS}
    one = place(GROUPS, levels, TrainingSetup("fp32", 0, 1, gradient_accumulation_steps=1))
    four = place(GROUPS, levels, TrainingSetup("fp32", 0, 1, gradient_accumulation_steps=4))
    assert four.setup.gradient_accumulation_steps == 4
    assert (one.moved_bytes_per_step, four.moved_bytes_per_step) == (8000 + 4000 + 2 * 4000, 8000 + 4000 + 4 * 2 * 4000)
    assert four.moved_bytes_per_step == 44000 and four.level_of("layer3") is L.HOST_PARAMS
    assert [p.bytes.moved_per_step for p in four.placements] == [0, 0, 8000, 36000, 0]
    assert one.host_stepped_numel == four.host_stepped_numel == 2000
    # at the documented defaults, 12 GB/s over PCIe and 5e8 params/s for the host Adam, per optimizer step
    assert (four.transfer_seconds, four.host_adam_seconds) == (pytest.approx(44000 / 12e9), pytest.approx(2000 / 5e8))
    assert four.offload_seconds_per_step == pytest.approx(3.6667e-6 + 4e-6, rel=1e-4)
    assert one.offload_seconds_per_step == pytest.approx(20000 / 12e9 + 2000 / 5e8)


def test_streamed_gradients_leave_the_device_every_micro_batch():
    # bf16 ZeRO 2 over 4 ranks, n = 1001 at host_params outside DeepSpeed: every micro-batch streams the fp32
    # gradient out (4004) and fetches the bf16 params for the forward and the backward (2 x 2002)
    zero2 = TrainingSetup("bf16", 2, 4, gradient_accumulation_steps=4)
    assert group_bytes(1001, L.HOST_PARAMS, zero2).moved_per_step == 4 * (4004 + 2 * 2002) == 32032
    # host_optimizer: DeepSpeed accumulates the gradient partition (252) on the device; out and master in once
    assert group_bytes(1001, L.HOST_OPTIMIZER, zero2).moved_per_step == 2 * 4 * 252
    # bf16 ZeRO 0: the engine all-reduces the gradients accumulated on the device after the last micro-batch, and
    # they go out once
    zero0 = TrainingSetup("bf16", 0, 2, gradient_accumulation_steps=4)
    assert group_bytes(1001, L.HOST_PARAMS, zero0).moved_per_step == 4004 + 4 * 2 * 2002
    # a pseudo layer set serving 6 layers, fp32 ZeRO 0: 6 fetches each way in every micro-batch, one gradient out
    shared = TrainingSetup("fp32", 0, 1, gradient_accumulation_steps=4)
    assert group_bytes(1000, L.HOST_PARAMS, shared, uses=6).moved_per_step == 4000 + 4 * 6 * 2 * 4000
    # the plan: 2016 + 32032 bytes at 12 GB/s and the host Adam over 252 + 1001 params at 5e8/s, per optimizer step
    groups = [GroupSize("layer0", 1001, 0), GroupSize("layer1", 1001, 1), GroupSize("other", 10)]
    plan = place(groups, {"layer0": L.HOST_OPTIMIZER, "layer1": L.HOST_PARAMS}, zero2)
    assert (plan.moved_bytes_per_step, plan.host_stepped_numel) == (34048, 1253)
    assert plan.offload_seconds_per_step == pytest.approx(34048 / 12e9 + 1253 / 5e8)


def test_zero2_holds_the_accumulated_gradient_partition_through_later_micro_batches():
    # bf16 ZeRO 2 over 2 ranks: layers of 1001 (m = 502) and other of 500 (m = 250). From the second micro-batch
    # on, DeepSpeed 0.19.8 keeps the partition accumulated so far while the backward fills a fresh one
    # (stage_1_and_2.py: all_grad_tensors beside a new grads_in_partition): (2 x 502 + 250) x 2 B more
    groups = [GroupSize("layer0", 1001, 0), GroupSize("layer1", 1001, 1), GroupSize("other", 500)]
    one = place(groups, {}, TrainingSetup("bf16", 2, 2, activation_bytes=10000))
    four = place(groups, {}, TrainingSetup("bf16", 2, 2, activation_bytes=10000, gradient_accumulation_steps=4))
    assert (one.accumulated_gradient_bytes, four.accumulated_gradient_bytes) == (0, 2508)
    assert four.backward_bytes - one.backward_bytes == four.device_bytes - one.device_bytes == 2508
    # a host_params group outside DeepSpeed accumulates on the host; ZeRO 1 accumulates into the full gradients
    # (already counted); ZeRO 0 has no partition
    assert place(groups, {"layer1": L.HOST_PARAMS}, four.setup).accumulated_gradient_bytes == 2 * (502 + 250)
    for stage in (0, 1):
        plan = place(groups, {}, TrainingSetup("bf16", stage, 2, gradient_accumulation_steps=4))
        assert plan.accumulated_gradient_bytes == 0, stage


def test_describe_plan_names_the_gradient_accumulation():
    setup = TrainingSetup("fp32", 0, 1, gradient_accumulation_steps=4)
    text = describe_plan(place(GROUPS, {"layer2": L.HOST_OPTIMIZER, "layer3": L.HOST_PARAMS}, setup))
    assert text.startswith("granular offload plan: fp32, ZeRO stage 0, data-parallel 1, gradient accumulation 4, "
                           "budget none (explicit levels)\n")
    assert (f"moved per optimizer step 42.97 KiB; modelled offload time per optimizer step "
            f"{44000 / 12e9 + 2000 / 5e8:.3g} s = PCIe {44000 / 12e9:.3g} s (at 12 GB/s) + host Adam "
            f"{2000 / 5e8:.3g} s (2,000 params at 5e+08/s)") in text
    with pytest.raises(PlanError, match=r"gradient_accumulation_steps: got 0, accepted: an integer >= 1"):
        TrainingSetup(gradient_accumulation_steps=0)


def test_streamed_gradients_with_accumulation_need_a_staging_buffer_on_the_host():
    """Later micro-batches' gradients land in a buffer of their own before they are added to the first one's."""
    one, four = (TrainingSetup("fp32", 2, 1, gradient_accumulation_steps=ga) for ga in (1, 4))
    assert host_buffers(1000, L.HOST_PARAMS, one) == (4000,) * 4  # params (the master), gradient, two moments
    assert host_buffers(1000, L.HOST_PARAMS, four) == (4000,) * 5
    zero0 = TrainingSetup("bf16", 0, 1, gradient_accumulation_steps=4)  # accumulated on the device: no staging
    assert host_buffers(1000, L.HOST_PARAMS, zero0) == (2000,) + (4000,) * 4


def test_the_overlapped_steps_backups_are_host_bytes_of_host_params_groups_outside_deepspeed():
    groups = [GroupSize("layer0", 1000, 0), GroupSize("layer1", 1000, 1)]
    levels = {"layer0": L.HOST_PARAMS, "layer1": L.HOST_OPTIMIZER}
    for dtype, per_param in (("fp32", 12), ("bf16", 14), ("fp16", 14)):  # master + moments (+ 16-bit host params)
        plain, kept = (place(groups, levels, TrainingSetup(dtype, 2, 1, host_step_backups=b)) for b in (False, True))
        assert kept.backup_bytes == per_param * 1000 and plain.backup_bytes == 0
        assert kept.host_bytes - plain.host_bytes == per_param * 1000
        assert kept.optimizer_host_bytes - plain.optimizer_host_bytes == per_param * 1000
        assert "the overlapped host step's backups" in describe_plan(kept)
        assert "backups" not in describe_plan(plain)
    # pageable: not rounded to pages where the other host buffers are pinned
    pinned = place(groups, levels, TrainingSetup("bf16", 2, 1, pinned_host=True, host_step_backups=True))
    unrounded = place(groups, levels, TrainingSetup("bf16", 2, 1, pinned_host=True))
    assert pinned.host_allocated_bytes - unrounded.host_allocated_bytes == 14 * 1000
    # ZeRO 0 keeps the gradients on the device until the step: nothing is stepped ahead, nothing backed up
    assert place(groups, levels, TrainingSetup("bf16", 0, 1, host_step_backups=True)).backup_bytes == 0


def test_the_delayed_host_step_holds_a_second_gradient_buffer_and_an_fp32_master():
    groups = [GroupSize("layer0", 1000, 0), GroupSize("layer1", 1000, 1)]
    levels = {"layer0": L.HOST_PARAMS, "layer1": L.HOST_OPTIMIZER}
    # fp32: a master apart from the host params (4 B) and a second gradient buffer (4 B); 16 bits: the master is
    # there already
    for dtype, per_param in (("fp32", 8), ("bf16", 4)):
        plain, delayed = (place(groups, levels, TrainingSetup(dtype, 1, 1, host_step=mode))
                          for mode in ("sequential", "delayed"))
        assert delayed.host_bytes - plain.host_bytes == per_param * 1000
        assert delayed.optimizer_host_bytes - plain.optimizer_host_bytes == per_param * 1000
        assert delayed.backup_bytes == 0  # nothing is stepped ahead, so nothing is backed up
    # pinned like the other host buffers: each in whole pages
    pinned = place(groups, levels, TrainingSetup("fp32", 1, 1, pinned_host=True, host_step="delayed"))
    assert pinned.host_allocated_bytes == sum(pinned_bytes(size) for p in pinned.placements for size in p.host_buffers)
    # ZeRO 0 steps host_params layers after the backward, in DeepSpeed's optimizer: nothing is delayed
    assert (place(groups, levels, TrainingSetup("fp32", 0, 1, host_step="delayed")).host_bytes
            == place(groups, levels, TrainingSetup("fp32", 0, 1)).host_bytes)
