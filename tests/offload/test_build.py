"""build_offload_optimizer on real, pseudo (shared-parameter) and DeepSpeed MoE models, without an engine."""
import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.offload import GranularOffloadOptimizer, PlanError, build_offload_optimizer, describe_offload_plan
from ds_pseudo_real.sharing import apply_sharing, parameter_count

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "Adam", "params": {"lr": 0.001, "adam_w_mode": False}},
          "granular_offload": {"levels": {"0": "host_optimizer"}}}
LAYER, OTHER = 8416, 4160  # TinyLM(d=32): per-layer and non-layer parameter counts


def test_absent_section_changes_nothing():
    config = {k: v for k, v in CONFIG.items() if k != "granular_offload"}
    assert build_offload_optimizer(TinyLM(), config, "layers", 2) == (None, config, None)


def test_real_model_groups_config_and_plan():
    config = copy.deepcopy(CONFIG)
    optimizer, patched, plan = build_offload_optimizer(TinyLM(), config, "layers", 2)
    assert config == CONFIG  # the caller's dict is not touched
    assert "optimizer" not in patched and patched["zero_allow_untested_optimizer"] is True
    assert patched["zero_force_ds_cpu_optimizer"] is False
    assert [(g["placement"], g["level"], sum(p.numel() for p in g["params"])) for g in optimizer.param_groups] == \
        [("layer0", "host_optimizer", LAYER)] + [(f"layer{i}", "device", LAYER) for i in (1, 2, 3)] + \
        [("other", "device", OTHER)]
    assert optimizer.adamw_mode is False and optimizer.defaults["lr"] == 0.001
    # ZeRO 1 over 2 ranks: layer0's partition is 4208; host master + grad buffer + moments = 16 B per element
    assert plan.optimizer_host_bytes == 16 * 4208
    assert "layer0              host_optimizer  8,416" in describe_offload_plan(plan)


def test_pseudo_model_counts_shared_parameters_once():
    model = apply_sharing(TinyLM(), "layers", groups=2)
    optimizer, _, plan = build_offload_optimizer(model, CONFIG, "layers", 1)
    assert [(p.group.name, p.group.numel, p.group.uses) for p in plan.placements] == \
        [("layer0", LAYER, 2), ("layer2", LAYER, 2), ("other", OTHER, 1)]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == parameter_count(model) \
        == 2 * LAYER + OTHER
    # ZeRO 1, 1 rank: partitions pad to a multiple of 2 -> 8416 and 4160 unchanged; moments 8 B per element
    assert plan.optimizer_device_bytes == 8 * (LAYER + OTHER)


@pytest.mark.parametrize("optimizer, message", [
    ({"type": "SGD", "params": {"lr": 0.1}}, "optimizer.type: got 'SGD'; granular_offload steps Adam-family "
                                             "optimizers only, accepted: 'Adam', 'AdamW'"),
    ({"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}, "optimizer.params: got keys ['torch_adam']"),
])
def test_optimizer_section_errors(optimizer, message):
    with pytest.raises(ConfigError) as info:
        build_offload_optimizer(TinyLM(), {**CONFIG, "optimizer": optimizer}, "layers", 1)
    assert message in str(info.value)


def test_budget_that_nothing_fits_says_how_much_is_missing():
    config = {**CONFIG, "granular_offload": {"device_memory": 1000, "max_level": "host_optimizer"}}
    with pytest.raises(ValueError, match=r"bytes\) missing"):
        build_offload_optimizer(TinyLM(), config, "layers", 1)


MOE_CONFIG = {**CONFIG, "zero_optimization": {"stage": 0},
              "granular_offload": {"levels": {"1": "host_optimizer", "2.experts": "host_optimizer"}}}
EXPERTS = 16768  # TinyLM(ep_size=1): 4 experts of 4192 per layer; the dense rest of a layer is 192


def test_moe_experts_are_deepspeed_moe_groups_of_their_own():
    optimizer, _, plan = build_offload_optimizer(TinyLM(ep_size=1), MOE_CONFIG, "layers", 1)
    groups = [(g["placement"], g["level"], g.get("moe", False), g.get("name"), sum(p.numel() for p in g["params"]))
              for g in optimizer.param_groups]
    assert groups == [(f"layer{i}", "host_optimizer" if i == 1 else "device", False, None, 192) for i in range(4)] + \
        [(f"layer{i}.experts", "host_optimizer" if i == 2 else "device", True, "ep_size_1", EXPERTS)
         for i in range(4)] + [("other", "device", False, None, OTHER)]
    assert all(p.allreduce is False for g in optimizer.param_groups if g.get("moe") for p in g["params"])
    assert plan.optimizer_host_bytes == 16 * (192 + EXPERTS)
    assert "layer0.experts..layer1.experts (2)  device" in describe_offload_plan(plan)


def test_expert_level_errors_name_the_group_and_what_is_accepted():
    bad_key = {**MOE_CONFIG, "granular_offload": {"levels": {"4.experts": "host_optimizer"}}}
    with pytest.raises(ConfigError) as info:
        build_offload_optimizer(TinyLM(ep_size=1), bad_key, "layers", 1)
    assert "granular_offload.levels: got keys ['4.experts'] not in the model; accepted: ['0', '1', '2', '3', " \
           "'0.experts', '1.experts', '2.experts', '3.experts', 'other']" in str(info.value)
    with pytest.raises(ConfigError, match=r"got keys \['0.experts'\] not in the model; accepted: \['0', '1', '2', "
                                          r"'3', 'other'\]"):
        build_offload_optimizer(TinyLM(), {**CONFIG, "granular_offload": {"levels": {"0.experts": "device"}}},
                                "layers", 1)
    every = {**MOE_CONFIG, "zero_optimization": {"stage": 1},
             "granular_offload": {"levels": {f"{i}.experts": "host_params" for i in range(4)}}}
    with pytest.raises(PlanError) as info:
        build_offload_optimizer(TinyLM(ep_size=1), every, "layers", 1)
    assert "every layer's experts at 'host_params' under ZeRO stage 1, fp32" in str(info.value)
    assert "put one layer's experts (e.g. '0.experts') at 'device' or 'host_optimizer'" in str(info.value)
    with pytest.raises(PlanError, match="granular_offload.levels.other: 'host_params' is for the layers' "
                                        "parameters .* accepted for 'other': 'device', 'host_optimizer'"):
        build_offload_optimizer(TinyLM(), {**CONFIG, "granular_offload": {"levels": {"other": "host_params"}}},
                                "layers", 1)


def test_experts_at_host_params_stay_in_deepspeeds_optimizer_only_at_fp32_zero0():
    """A layer's experts at host_params are fetched with their layer; under ZeRO 1 they become an own group of
    the offload optimizer (DeepSpeed's expert group name kept, for the expert-data-parallel reduction)."""
    levels = {"granular_offload": {"levels": {"1.experts": "host_params", "1": "host_params"}}}
    for stage, own in ((0, []), (1, [("layer1", None), ("layer1.experts", "ep_size_1")])):
        config = {**MOE_CONFIG, "zero_optimization": {"stage": stage}, **levels}
        optimizer, _, plan = build_offload_optimizer(TinyLM(ep_size=1), config, "layers", 1)
        assert [(g["placement"], g.get("name")) for g in optimizer.own_param_groups] == own
        # the layer's dense part and its experts are one fetch: the buffer holds two such layers at most
        assert plan.prefetch_buffer_bytes == 4 * (192 + EXPERTS)
        assert [len(e) for e in optimizer.host_params._entries] == [3 + 4 * 4]  # norm, gate; 4 experts of 2 Linear
        optimizer.remove_hooks()


def test_checkpoint_with_the_plan_name_under_name_still_loads():
    """Optimizer states saved before expert groups existed hold the plan's group name under "name": loading them
    keeps the current groups' keys, so an expert group's "name" stays DeepSpeed's expert group."""
    model = TinyLM(ep_size=1)
    optimizer, _, _ = build_offload_optimizer(model, MOE_CONFIG, "layers", 1)
    model(*batch(0, 0)).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        group["name"] = group.pop("placement")
        group.pop("moe", None)
    fresh, _, _ = build_offload_optimizer(model, MOE_CONFIG, "layers", 1)
    fresh.load_state_dict(saved)
    keys = [(g["placement"], g.get("name"), g.get("moe")) for g in fresh.param_groups]
    assert keys == [(g["placement"], g.get("name"), g.get("moe")) for g in optimizer.param_groups]
    assert keys[4] == ("layer0.experts", "ep_size_1", True) and keys[0] == ("layer0", None, None)
    assert all(torch.equal(fresh.state[p]["exp_avg"], optimizer.state[p]["exp_avg"]) for p in model.parameters())


def test_groups_built_by_hand_without_placement_are_all_accounted():
    model = TinyLM()
    optimizer = GranularOffloadOptimizer([{"params": list(layer.parameters()), "level": "host_optimizer"}
                                          for layer in model.layers] + [{"params": list(model.embed.parameters())
                                                                         + list(model.head.parameters())}])
    model(*batch(0, 0)).backward()
    optimizer.step()
    assert optimizer.held_bytes() == {"device": 8 * OTHER, "host": 16 * 4 * LAYER}
    assert optimizer.moved_bytes == optimizer.moved_bytes_by_group[None] == 8 * 4 * LAYER


@pytest.mark.parametrize("host_step", ["overlapped", "delayed"])
def test_a_host_step_mode_with_nothing_to_change_says_so(host_step, monkeypatch):
    """At ZeRO 0 in fp32 the host_params layers are DeepSpeed's to step after the backward: neither mode can change
    anything there, and the log says it once; at ZeRO 1 they are the offload's own, and nothing is said."""
    import ds_pseudo_real.ranks as ranks

    said = []
    monkeypatch.setattr(ranks, "log_rank0", said.append)
    for stage in (0, 1):
        config = {**copy.deepcopy(CONFIG), "zero_optimization": {"stage": stage}}
        config["granular_offload"] = {"levels": {"0": "host_params"}, "host_step": host_step}
        optimizer, _, _ = build_offload_optimizer(TinyLM(), config, "layers", 1)
        assert (optimizer.ahead is not None, optimizer.delayed is not None) == (
            (host_step == "overlapped" and stage == 1), (host_step == "delayed" and stage == 1))
        optimizer.remove_hooks()
    assert said == [f"granular_offload.host_step '{host_step}': no layer here is stepped by the offload itself "
                    f"(host_params under ZeRO 1/2), so every host step runs after the backward, as 'sequential'"]
