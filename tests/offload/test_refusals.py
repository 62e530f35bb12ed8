"""Granular offload refuses what it would get wrong: model parallelism (its own groups' gradients are reduced over
every rank, the data-parallel group only without it) and DeepSpeed or torch releases outside the tested range."""
import sys
from pathlib import Path

import pytest

import ds_pseudo_real
from ds_pseudo_real.config import ConfigError

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from delink_matrix import config, tiny_gpt  # noqa: E402


class TwoWayTensorParallel:
    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_pipeline_model_parallel_world_size(self):
        return 1


@pytest.mark.parametrize("extra, mpu, named", [
    ({}, TwoWayTensorParallel(), "'tensor parallel (mpu)': 2"),
    ({"tensor_parallel": {"autotp_size": 2}}, None, "'tensor_parallel.autotp_size': 2"),
    ({"sequence_parallel_size": 2}, None, "'sequence_parallel_size': 2"),
], ids=["mpu", "autotp", "sequence"])
def test_model_parallelism_with_granular_offload_is_refused(extra, mpu, named):
    cfg = {**config(1, "fp32", "copy"), **extra, "granular_offload": {"levels": {"0": "host_optimizer"}}}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="granular_offload works with data \\(and expert\\) parallelism only") as raised:
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg, mpu=mpu)
    assert named in str(raised.value)


@pytest.mark.parametrize("package, version", [("deepspeed", "0.20.1"), ("deepspeed", "0.18.9"), ("torch", "2.16.0")])
def test_a_release_outside_the_tested_range_is_refused(monkeypatch, package, version):
    import deepspeed
    import torch

    from ds_pseudo_real.ds_state import SUPPORTED_VERSIONS

    monkeypatch.setattr(deepspeed if package == "deepspeed" else torch, "__version__", version)
    cfg = {**config(1, "fp32", "copy"), "granular_offload": {"levels": {"0": "host_optimizer"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    low, high = SUPPORTED_VERSIONS[package]
    with pytest.raises(RuntimeError, match=f"granular_offload was written against {package} >={low},<{high}; "
                                           f"found {package} {version}"):
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)

