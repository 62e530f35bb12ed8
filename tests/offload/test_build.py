"""build_offload_optimizer on real and pseudo (shared-parameter) models, without an engine."""
import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import TinyLM  # noqa: E402

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.offload import build_offload_optimizer, describe_offload_plan
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
    assert [(g["name"], g["level"], sum(p.numel() for p in g["params"])) for g in optimizer.param_groups] == \
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
