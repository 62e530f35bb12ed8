"""The granular_offload section's validation and the ``plan`` command's output."""
import json
from pathlib import Path

import pytest
from conftest import REPO

from ds_pseudo_real.cli import main as cli_main
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.offload.config import explicit_levels, parse_granular_offload, training_setup
from ds_pseudo_real.offload.planner import PlacementLevel, uniform_groups


def test_absent_or_disabled_section_is_none():
    assert parse_granular_offload({"train_batch_size": 4}) is None
    assert parse_granular_offload({"granular_offload": {"enabled": False}}) is None


def test_budget_units_and_defaults():
    section = parse_granular_offload({"granular_offload": {"device_memory": "2GiB", "reserved": "1MB"}})
    assert (section.device_memory, section.reserved, section.max_level) == (2 * 2**30, 10**6, "host_params")


@pytest.mark.parametrize("raw, expected", [
    ({"device_memory": "1GB", "bogus": 1}, "granular_offload.bogus: unknown key (got 1)"),
    ({"levels": ["device", "on_disk"]}, "granular_offload.levels: Value error, [1] is 'on_disk'; accepted levels: "
                                        "['device', 'host_optimizer', 'host_params'] (got ['device', 'on_disk'])"),
    ({"device_memory": "lots"}, "granular_offload.device_memory: Value error, expected a byte count like"),
    ({}, "give exactly one of device_memory (plan within a budget) or levels"),
    ({"levels": {"x": "device"}}, "key 'x': accepted keys are layer indices ('0', '1', ...), a layer's experts ('0.experts') and 'other'"),
    ({"device_memory": 1, "max_level": "disk"}, "granular_offload.max_level: Input should be 'device'"),
])
def test_errors_name_key_value_and_accepted(raw, expected):
    with pytest.raises(ConfigError) as info:
        parse_granular_offload({"granular_offload": raw})
    assert expected in str(info.value)


def test_setup_from_deepspeed_config_and_conflicts():
    section = parse_granular_offload({"granular_offload": {"device_memory": 10, "activation_bytes": 77}})
    setup = training_setup({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, section, 8, 4)
    assert (setup.dtype, setup.zero_stage, setup.dp_size, setup.activation_bytes) == ("bf16", 2, 8, 77)
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer: got \{'device': 'cpu'\}"):
        training_setup({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, section, 1, 4)
    with pytest.raises(ConfigError, match="zero_optimization.stage: got 3, granular offload accepts 0, 1, 2"):
        training_setup({"zero_optimization": {"stage": 3}}, section, 1, 4)


def test_explicit_levels_list_and_dict():
    groups = uniform_groups(3, 10, 5)
    section = parse_granular_offload({"granular_offload": {"levels": {"2": "host_optimizer", "other": "host_optimizer"}}})
    assert explicit_levels(section, groups) == {"layer2": PlacementLevel.HOST_OPTIMIZER,
                                                "other": PlacementLevel.HOST_OPTIMIZER}
    section = parse_granular_offload({"granular_offload": {"levels": ["device", "host_params"]}})
    with pytest.raises(ConfigError, match="got a list of 2 levels, the model has 3 layers"):
        explicit_levels(section, groups)
    section = parse_granular_offload({"granular_offload": {"levels": {"7": "device"}}})
    with pytest.raises(ConfigError, match=r"got keys \['7'\] not in the model; accepted: \['0', '1', '2', 'other'\]"):
        explicit_levels(section, groups)


def write_config(tmp_path, section):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}, "granular_offload": section}))
    return str(path)


def test_plan_command_prints_the_table(tmp_path, capsys):
    # 4 layers of 1000 fp32 params at ZeRO 0 need 16000 bytes each on the device, 8000 at host_optimizer
    config = write_config(tmp_path, {"device_memory": 1, "max_level": "host_optimizer",
                                     "model": {"num_layers": 4, "layer_params": 1000}})
    assert cli_main(["plan", "--config", config, "--device-memory", "50000", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "without offload: device 62.50 KiB per rank (does not fit 48.83 KiB)" in out
    # 64000 - 50000: two layers must free 8000 each; the later layers go first
    assert "layer0..layer1 (2)  device          1,000        15.62 KiB    0 B        0 B" in out
    assert "layer2..layer3 (2)  host_optimizer  1,000        7.81 KiB     15.62 KiB  7.81 KiB" in out
    assert "device total 46.88 KiB (48000 B)" in out


def test_plan_command_says_what_is_missing(tmp_path, capsys):
    config = write_config(tmp_path, {"device_memory": 1, "max_level": "host_optimizer",
                                     "model": {"num_layers": 4, "layer_params": 1000}})
    assert cli_main(["plan", "--config", config, "--device-memory", "30000"]) == 2
    assert "device needs 31.25 KiB, 1.95 KiB (2000 bytes) missing" in capsys.readouterr().err


def test_experts_are_groups_of_their_own(tmp_path, capsys):
    # 2 layers of 1000 dense + 4000 expert params per rank; 8 ranks, experts spread over 4: each expert is
    # replicated on 2 ranks, so ZeRO 1 partitions the experts 2 ways and the dense params 8 ways
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "granular_offload": {
        "levels": {"1.experts": "host_optimizer"},
        "model": {"num_layers": 2, "layer_params": 1000, "expert_params": 4000, "expert_parallel": 4}}}))
    assert cli_main(["plan", "--config", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    # dense: params 4000 + grads 4000 + master 4 * 126 + moments 8 * 126 (1000 padded to 1008, / 8)
    assert "layer0..layer1 (2)  device          1,000        9.29 KiB" in out
    # experts at host_optimizer: device params + grads + master 4 * 2000; host 16 * 2000
    assert "layer1.experts      host_optimizer  4,000        39.06 KiB    31.25 KiB" in out


def test_m6_10t_config_on_512_ranks_of_32gb(capsys, tmp_path):
    """configs/offload_m6_10t.json (bf16, ZeRO 1, experts spread over all 512 ranks): the fully shared pseudo model
    fits without offload. The real one fits only with experts at host_params: each rank's 48 x 409M expert
    parameters are not ZeRO-partitioned (replicated once), so at host_optimizer their bf16 params, grads and
    DeepSpeed's fp32 copy stay on the device."""
    config = str(REPO / "configs" / "offload_m6_10t.json")
    assert cli_main(["plan", "--config", config, "--world-size", "512", "--shared-groups", "1"]) == 0
    out = capsys.readouterr().out
    assert "without offload: device 8.31 GiB per rank (fits 29.80 GiB)" in out
    experts = 408944640
    assert f"layer0.experts  device  {experts:,}  6.09 GiB" in out
    assert cli_main(["plan", "--config", config, "--world-size", "512"]) == 0
    out = capsys.readouterr().out
    # fetched: bf16 params 2 + fp32 master 4 + gradient buffer 4 + moments 8 B per param on the host
    assert f"layer4.experts..layer47.experts (44)  host_params     {experts:,}  0 B          6.86 GiB" in out
    assert "layer3.experts                        host_optimizer" in out  # DeepSpeed keeps one MoE group
    assert "device total 28.41 GiB (30505898928 B)" in out
    assert "prefetch buffer 1.52 GiB, streamed gradients 780.00 MiB" in out  # 2 and 1 layers' experts in bf16
    raw = json.loads(Path(config).read_text())
    raw["granular_offload"]["max_level"] = "host_optimizer"
    capped = tmp_path / "capped.json"
    capped.write_text(json.dumps(raw))
    assert cli_main(["plan", "--config", str(capped), "--world-size", "512"]) == 2
    err = capsys.readouterr().err
    # per expert group at host_optimizer: bf16 params + grads (2 + 2 B) + fp32 copy (4 B) stay on the device
    assert "the device needs 151.05 GiB" in err and "121.24 GiB (130185038416 bytes) missing" in err
    assert 48 * 8 * experts < 151.05 * 2**30 < 48 * 8 * experts + 2**30 * 6


def test_m6_config_plans_its_experts_per_layer(tmp_path, capsys):
    """configs/m6_10t.json: the m6 section says which parameters are experts (20 of the 10,240 per layer on each
    of 512 ranks); when nothing fits, the furthest placement is printed with every group's level."""
    assert cli_main(["plan", "--config", str(REPO / "configs" / "m6_10t.json"), "--world-size", "512"]) == 0
    assert "layer4.experts..layer47.experts (44)  host_params" in capsys.readouterr().out
    raw = json.loads((REPO / "configs" / "m6_10t.json").read_text())
    raw["granular_offload"]["max_level"] = "host_optimizer"
    capped = tmp_path / "capped.json"
    capped.write_text(json.dumps(raw))
    assert cli_main(["plan", "--config", str(capped), "--world-size", "512"]) == 2
    captured = capsys.readouterr()
    assert "model: the m6 section (48 layers of 14,684,160 dense + 408,944,640 expert parameters per rank, " \
           "experts over 512 ranks)" in captured.out
    assert "furthest placement (does not fit):" in captured.out
    assert "layer0.experts..layer47.experts (48)  host_optimizer  408,944,640  3.05 GiB     6.09 GiB" in captured.out
    assert "119.16 GiB (127948425808 bytes) missing" in captured.err
    raw = json.loads((REPO / "configs" / "m6_tiny.json").read_text())
    raw["granular_offload"]["model"]["other_params"] += 1
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert cli_main(["plan", "--config", str(path)]) == 2
    assert "granular_offload.model: got 4 layers of 148224 parameters and 10369 others per rank; the m6 section " \
           "(m6-tiny, expert_parallel 1) has 4 layers of 148224 and 10368" in capsys.readouterr().err
