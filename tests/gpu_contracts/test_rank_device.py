"""On local rank 3 of a node with 8 GPUs, granular offload lives on cuda:3: the device is current before DeepSpeed
builds the engine, the host-param store, its fetched copies and the host step's streams are on cuda:3, no CUDA
context is made on another GPU, and every copy to the host runs on the stream whose event the host waits for."""
import os
import sys

import deepspeed
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "offload"))
from tiny_model import TinyLM, batch, offload_config  # noqa: E402

import ds_pseudo_real  # noqa: E402

CUDA3 = torch.device("cuda", 3)
LEVELS = {"0": "host_params", "1": "host_optimizer", "2": "host_params", "3": "device"}


class EngineReached(Exception):
    pass


def offload_optimizer_as_built(monkeypatch, stage):
    """What ds_pseudo_real.initialize hands to deepspeed.initialize, and the current device at that moment (the
    engine itself cannot run on fake devices: DeepSpeed's CUDA ops)."""
    reached = {}

    def initialize(**kwargs):
        reached.update(device=torch.cuda.current_device(), optimizer=kwargs["optimizer"])
        raise EngineReached

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    cfg = offload_config(stage, "host_params")
    cfg["granular_offload"]["levels"] = dict(LEVELS)
    torch.manual_seed(0)
    model = TinyLM()
    with pytest.raises(EngineReached):
        ds_pseudo_real.initialize(model=model, config=cfg)
    return model, reached["device"], reached["optimizer"]


def reference_gradients():
    torch.manual_seed(0)
    model = TinyLM()
    model(*batch(0, 0)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 2])
def test_offload_lives_on_the_ranks_gpu(fake_gpu_rank, monkeypatch, stage):
    model, current, optimizer = offload_optimizer_as_built(monkeypatch, stage)
    assert current == 3
    store, host = optimizer.host_params, optimizer.host
    assert store.device == CUDA3 and store._stream.device == CUDA3
    assert host.to_host_stream.device == CUDA3 and host.to_device_stream.device == CUDA3
    model.to(CUDA3)  # as the engine does; the host_params layers stay on the host
    assert model.layers[0].up.weight.device.type == "cpu" and model.layers[3].up.weight.device == CUDA3
    x, y = (t.to(CUDA3) for t in batch(0, 0))
    model(x, y).backward()
    if stage == 0:  # the host_params groups are DeepSpeed's: the step copies their gradients
        optimizer.step()
    else:  # own groups: streamed to the host during the backward
        optimizer.own_gradients.settle()
    assert fake_gpu_rank.touched == {CUDA3}
    assert {a.device for a in fake_gpu_rank.allocations} == {CUDA3}
    assert fake_gpu_rank.misplaced_work() == [] and fake_gpu_rank.unwaited_copies() == []
    assert all(e.device == CUDA3 for e in fake_gpu_rank.events) and fake_gpu_rank.events
    expected = reference_gradients()
    names = {p: name for name, p in model.named_parameters()}
    on_host = optimizer.param_groups + optimizer.own_param_groups if stage == 0 else optimizer.own_param_groups
    offloaded = [p for g in on_host if g["level"] != "device" for p in g["params"]]
    assert all(host.grad_buffers[p].is_pinned() and host.grad_buffers[p].device.type == "cpu" for p in offloaded)
    assert all(torch.equal(host.grad_buffers[p], expected[names[p]]) for p in offloaded)
    optimizer.remove_hooks()
