"""The DeepSpeed internals the plugin reaches into are checked when the engine is built: a release where one moved
fails at initialize naming it (simulated by deleting it), never later or silently. A moment the delink cannot read
is an error naming the parameter, never a silent ``reset``; an old-style mpu with model parallelism is refused
under granular offload."""
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import ds_pseudo_real
from ds_pseudo_real import ds_state

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from delink_matrix import config, fixed_batch, tiny_gpt  # noqa: E402

SUPPORTED = "deepspeed >={},<{}".format(*ds_state.SUPPORTED_VERSIONS["deepspeed"])


def engine_of(stage, dtype="fp32", **extra):
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config={**config(stage, dtype, "copy"), **extra})
    return engine


@pytest.mark.parametrize("stage, dtype, extra, optimizer", [
    (0, "fp32", {}, "AdamW"),
    (0, "bf16", {}, "FP16_UnfusedOptimizer"),
    (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer"),
    (2, "bf16", {}, "DeepSpeedZeroOptimizer"),
    (3, "bf16", {}, "DeepSpeedZeroOptimizer_Stage3"),
])
def test_every_engine_the_plugin_supports_has_the_internals_it_uses(stage, dtype, extra, optimizer):
    """Checked right after initialize: an attribute DeepSpeed sets later (BF16_Optimizer's _global_grad_norm, at its
    first step) must not be required."""
    engine = engine_of(stage, dtype, **extra).engine
    assert type(engine.optimizer).__name__ == optimizer
    features = ["pseudo_to_real", "save_checkpoint", "monitors", "granular_offload host_params", "convert"]
    ds_state.check_internals(engine, *features, *(["granular_offload"] if stage < 3 else []))


@pytest.mark.parametrize("owners, attribute, stage", [
    ((DeepSpeedZeroOptimizer,), "_lazy_init_hp_params_optimizer_state", 1),
    ((DeepSpeedEngine,), "destroy", 0),
    ((TorchCheckpointEngine, CheckpointEngine), "save", 0),  # the base class declares it too
], ids=["zero-optimizer", "engine", "checkpoint-engine"])
def test_initialize_names_a_deepspeed_internal_that_moved(monkeypatch, owners, attribute, stage):
    for owner in owners:
        monkeypatch.delattr(owner, attribute)
    with pytest.raises(RuntimeError, match=f"{owners[0].__name__}\\.{attribute}\\b") as raised:
        engine_of(stage)
    message = str(raised.value)
    assert f"found deepspeed {deepspeed.__version__}" in message and SUPPORTED in message


def test_without_pseudo_to_real_its_internals_are_not_required(monkeypatch):
    monkeypatch.delattr(DeepSpeedZeroOptimizer, "_lazy_init_hp_params_optimizer_state")
    cfg = config(1, "fp32", "copy")
    cfg["pseudo_to_real"]["enabled"] = False
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    assert engine.stage == "real"


@pytest.mark.parametrize("stage, dtype, extra, attribute, named", [
    (1, "bf16", {}, "_hp_optimizer_states_linked", "DeepSpeedZeroOptimizer._hp_optimizer_states_linked"),
    (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, "_hp_optimizer_states_linked",
     "BF16_Optimizer._hp_optimizer_states_linked"),
    (3, "fp32", {}, "fp32_partitioned_groups_flat", "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat"),
    (0, "bf16", {}, "fp32_groups", "FP16_UnfusedOptimizer.fp32_groups"),
], ids=["zero1-bf16", "zero1-bf16-fp32-accumulation", "zero3", "stage0-bf16-unfused"])
def test_an_instance_attribute_the_delink_reads_is_checked(stage, dtype, extra, attribute, named):
    engine = engine_of(stage, dtype, **extra).engine
    ds_state.check_internals(engine, "pseudo_to_real")
    delattr(engine.optimizer, attribute)
    with pytest.raises(RuntimeError, match=f"pseudo_to_real uses {named}, which this DeepSpeed"):
        ds_state.check_internals(engine, "pseudo_to_real")


@pytest.mark.parametrize("stage, attribute", [(1, "_hp_mapping"), (3, "ds_id")])
def test_a_parameter_attribute_deepspeed_no_longer_sets_is_named(stage, attribute):
    engine = engine_of(stage).engine
    for param in engine.module.parameters():
        param.__dict__.pop(attribute, None)
    with pytest.raises(RuntimeError, match=f"Parameter\\.{attribute} \\(under DeepSpeedZeroOptimizer"):
        ds_state.check_internals(engine, "pseudo_to_real")


def test_an_optimizer_wrapper_the_delink_cannot_read_is_refused():
    """DeepSpeed's fused stage-0 fp16/bf16 optimizer keeps its fp32 masters and moments in flat tensors ds_state does
    not map: reading it would give the low-precision weights and no moments, a silent ``reset``."""
    engine = engine_of(0).engine
    wrapper = FP16_Optimizer.__new__(FP16_Optimizer)
    wrapper.optimizer = engine.optimizer
    engine.optimizer = wrapper
    with pytest.raises(RuntimeError, match="pseudo_to_real was written for engines whose optimizer is one of .*; "
                                           "this engine's is FP16_Optimizer"):
        ds_state.check_internals(engine, "pseudo_to_real")


def test_granular_offload_internals_of_the_engine_are_checked(monkeypatch):
    engine = engine_of(1, "bf16").engine
    ds_state.check_internals(engine, "granular_offload")
    monkeypatch.delattr(DeepSpeedZeroOptimizer, "scaled_global_norm")
    with pytest.raises(RuntimeError, match="granular_offload uses DeepSpeedZeroOptimizer.scaled_global_norm, which"):
        ds_state.check_internals(engine, "granular_offload")


@pytest.mark.parametrize("target, attribute, named", [
    ("kernel", "adam_update", "DeepSpeedCPUAdam.ds_opt_adam.adam_update"),
    ("optimizer", "opt_id", "DeepSpeedCPUAdam.opt_id"),
])
def test_the_cpu_adam_kernel_entry_points_are_checked(monkeypatch, target, attribute, named):
    cpu_adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
    ds_state.check_cpu_adam(cpu_adam, "granular_offload")
    monkeypatch.delattr(cpu_adam.ds_opt_adam if target == "kernel" else cpu_adam, attribute)
    with pytest.raises(RuntimeError, match=f"granular_offload uses {named}, which this DeepSpeed"):
        ds_state.check_cpu_adam(cpu_adam, "granular_offload")


@pytest.mark.parametrize("stage", [0, 1])
def test_copying_moments_an_optimizer_does_not_keep_fails_naming_the_parameter(stage):
    """SGD with momentum keeps no Adam moments: ``copy`` must not silently start the real model's from zero."""
    cfg = {**config(stage, "fp32", "copy", switch=1), "zero_allow_untested_optimizer": True}
    cfg.pop("optimizer")
    engine, *_ = ds_pseudo_real.initialize(
        model=tiny_gpt(), config=cfg, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    loss = engine(*fixed_batch(1))
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="cannot read the Adam moments of [a-z_.0-9]+weight"):
        engine.step()
    assert engine.stage == "pseudo"
