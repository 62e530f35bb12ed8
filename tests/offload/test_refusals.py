"""Granular offload refuses what it would get wrong: DeepSpeed's AutoTP (it splits the layers after the plan was
made from the whole ones), sequence parallelism (gradients averaged over a group its own groups' reduction does not
use) and DeepSpeed or torch releases outside the tested range. Tensor and pipeline parallelism are accepted
(test_model_parallel.py)."""
import sys
from pathlib import Path

import pytest

import ds_pseudo_real
from ds_pseudo_real.config import ConfigError

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from delink_matrix import config, tiny_gpt  # noqa: E402


@pytest.mark.parametrize("extra, named", [
    ({"tensor_parallel": {"autotp_size": 2}}, "'tensor_parallel.autotp_size': 2"),
    ({"sequence_parallel_size": 2}, "'sequence_parallel_size': 2"),
], ids=["autotp", "sequence"])
def test_autotp_and_sequence_parallelism_with_granular_offload_are_refused(extra, named):
    cfg = {**config(1, "fp32", "copy"), **extra, "granular_offload": {"levels": {"0": "host_optimizer"}}}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="granular_offload works with data, expert, tensor .* and pipeline "
                                          "parallelism; this run has") as raised:
        ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
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

