"""The CPU compatibility layer: what it patches, that it undoes it, and when it refuses to act."""
import logging

import pytest
import torch

from megatron_patches import PATCHES, cpu_compat

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def test_install_redirects_cuda_and_uninstall_restores():
    original = torch.cuda.current_device
    rng_logger = logging.getLogger("megatron.core.tensor_parallel.random")
    filters = rng_logger.filters
    assert cpu_compat.install() is True
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # what DistributedOptimizer checks
        record = logging.LogRecord(rng_logger.name, logging.WARNING, "", 0, "CPU RNG state changed within GPU RNG "
                                   "context", None, None)
        assert not rng_logger.filter(record)  # the CPU is the tracker's generator: spurious here
    finally:
        cpu_compat.uninstall()
    assert torch.cuda.current_device is original and not cpu_compat.is_installed()
    assert rng_logger.filters is filters
    assert torch.ones(2).type() == "torch.FloatTensor"
    assert torch.zeros(2).device.type == "cpu"


def test_every_patch_is_listed_once():
    patches = [*cpu_compat.PATCHES, *cpu_compat.TRAINING_PATCHES]
    targets = [p.target for p in patches]
    assert len(targets) == len(set(targets)) and all(p.reason for p in patches)
    assert all(any(p.target in line for line in PATCHES) for p in patches)


def test_never_active_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.current_device
    assert cpu_compat.install() is False
    assert torch.cuda.current_device is original and not cpu_compat.is_installed()


def test_refuses_other_megatron_versions(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"written against megatron-core 0\.16\.x.*found megatron-core 0\.17\.0"):
        cpu_compat.install()
    assert not cpu_compat.is_installed()


def test_torch_norm_accepts_sequence_parallel_and_marks_its_weights():
    """MoE with TP>1 needs sequence parallelism; the norm's weights then see one rank's tokens and must be
    all-reduced over TP (finalize_model_grads reads the ``sequence_parallel`` mark)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True)
    assert cpu_compat.install() is True
    try:
        norm = WrappedTorchNorm(config, 8)
        assert isinstance(norm, torch.nn.LayerNorm) and config.sequence_parallel
        assert [p.sequence_parallel for p in norm.parameters()] == [True, True]
        x = torch.randn(3, 8)
        assert torch.equal(norm(x), torch.nn.functional.layer_norm(x, (8,)))
    finally:
        cpu_compat.uninstall()
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 8)
