"""After the delink nothing of the pseudo engine stays reachable, whatever the caller kept: the engine, its optimizer
(ZeRO flat buffers, granular offload's host buffers) and the hooks DeepSpeed left on the caller's module. The module
the caller holds is dead: using it says to use ``engine.module``."""
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

import ds_pseudo_real
from ds_pseudo_real import ds_state

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import config, fixed_batch, tiny_gpt  # noqa: E402
from test_moe_delink import MoELM, moe_groups  # noqa: E402


def train_through_the_switch(engine, steps=3):
    for step in range(steps):
        loss = engine(*fixed_batch(step))
        engine.backward(loss)
        engine.step()


def pseudo_objects(engine):
    """Weak references to the pseudo engine and everything it owns that holds memory."""
    refs = {"engine": weakref.ref(engine.engine), "optimizer": weakref.ref(engine.engine.optimizer),
            "basic optimizer": weakref.ref(ds_state.basic_optimizer(engine.engine))}
    for name in ("bit16_groups_flat", "single_partition_of_fp32_groups", "fp16_partitioned_groups_flat",
                 "fp32_partitioned_groups_flat"):
        flats = getattr(engine.engine.optimizer, name, None)
        if flats:
            refs[name] = weakref.ref(flats[0])
    return refs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "granular-offload"])
def test_the_caller_keeping_its_model_keeps_nothing_of_the_pseudo_engine(stage, offload):
    if offload and stage == 3:
        pytest.skip("granular offload is refused under ZeRO-3")
    cfg = config(stage, "fp32", "copy", switch=2)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-3}}
    if offload:
        cfg["granular_offload"] = {"levels": {"0": "host_optimizer"}}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    model = tiny_gpt()
    engine, optimizer, _, scheduler = ds_pseudo_real.initialize(model=model, config=cfg)
    # the caller keeps model, optimizer and scheduler: the last two follow the controller to the real engine
    refs = pseudo_objects(engine)
    train_through_the_switch(engine)
    assert engine.stage == "real"
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == [], f"still reachable after the delink: {alive}"
    assert model is not engine.module and all(p.numel() == 0 for p in model.parameters())  # storage released
    with pytest.raises(RuntimeError, match="this module was the pseudo model.*read the model as engine.module"):
        model(fixed_batch(0)[0])
    assert optimizer.param_groups is engine.optimizer.param_groups and scheduler.get_lr() == engine.lr_scheduler.get_lr()
    train_through_the_switch(engine, 4)  # the real engine trains on
    engine.engine.destroy()


def test_the_moe_pseudo_engine_is_freed_too():
    torch.manual_seed(0)
    model = MoELM()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "pseudo_to_real": {"switch": {"at_step": 2}}}
    engine, *kept = ds_pseudo_real.initialize(model=model, config=cfg, model_parameters=moe_groups)
    refs = pseudo_objects(engine)
    train_through_the_switch(engine)
    gc.collect()
    assert engine.stage == "real" and [name for name, ref in refs.items() if ref() is not None] == []
    with pytest.raises(RuntimeError, match="engine.module"):
        model(fixed_batch(0)[0])
    engine.engine.destroy()


def test_destroy_ends_the_engine_the_offloads_worker_and_the_module():
    """``engine.destroy()`` of the real engine with its host_params layer stepped a step late: the step in flight
    finished, the worker thread gone, nothing of the engine reachable, the module's weights released (a forward
    says the engine was destroyed)."""
    cfg = config(1, "fp32", "copy", switch=2)
    cfg["granular_offload"] = {"levels": {"0": "host_params"}, "host_step": "delayed", "delayed_from_step": 0}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=cfg)
    train_through_the_switch(engine)
    assert engine.stage == "real"
    delayed = ds_state.basic_optimizer(engine.engine).delayed
    in_flight = list(delayed._queued)  # at step 3, the real optimizer's first: a publishing, then the step
    assert delayed.delayed == 1 and len(in_flight) == 2
    workers = list(delayed._worker._threads)  # its executor's thread
    del delayed  # it holds the optimizer
    refs, module = pseudo_objects(engine), engine.module
    engine.destroy()
    assert all(future.done() and future.exception() is None for future in in_flight)
    assert workers and not any(thread.is_alive() for thread in workers)
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    assert all(p.numel() == 0 for p in module.parameters())
    with pytest.raises(RuntimeError, match=r"this module's engine was destroyed \(engine.destroy\(\)\)"):
        module(fixed_batch(0)[0])
