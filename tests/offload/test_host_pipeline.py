"""The host step is pipelined: the gradients of every batch are copied to the host before the kernel waits for the
first, the host waits once per batch (never per parameter), and cutting a layer into batches changes no bit of
training. Under ZeRO 1/2 DeepSpeed hands a layer over as one flat partition, so a layer is cut into batches; under
ZeRO 0 a layer's parameters make one batch."""
import os
import sys

import deepspeed
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch, offload_config  # noqa: E402

from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402
from ds_pseudo_real.offload.host_adam import batches  # noqa: E402

LAYER = 8416  # elements of one TinyLM layer


def test_groups_are_cut_into_bounded_batches_that_never_mix_groups():
    a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(7))
    c, unused = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    for p in (a, b, c):
        p.grad = torch.zeros_like(p)
    work = batches([{"params": [a, b, unused], "placement": "layer0"}, {"params": [c], "placement": "layer1"}], 4)
    assert [(w.name, [(p.numel(), s, e) for p, s, e in w.pieces]) for w in work] == [
        ("layer0", [(5, 0, 4)]), ("layer0", [(5, 4, 5), (7, 0, 3)]), ("layer0", [(7, 3, 7)]),
        ("layer1", [(3, 0, 3)]),
    ]


def train(stage, level, batch_numel=None, trace_step=None):
    torch.manual_seed(0)
    model = TinyLM()
    cfg = offload_config(stage, level)
    optimizer, patched, _ = build_offload_optimizer(model, cfg, "layers", 1)
    if batch_numel is not None:
        optimizer.host.batch_numel = batch_numel
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    losses, trace = [], None
    for step in range(3):
        if step == trace_step:
            optimizer.host.trace = trace = []
        loss = engine(*batch(step, 0))
        engine.backward(loss)
        engine.step()
        optimizer.host.trace = None
        losses.append(loss.item())
    engine.destroy()
    optimizer.remove_hooks()
    return losses, trace


def test_zero2_cuts_each_flat_layer_partition_and_copies_ahead_of_the_kernel():
    reference, _ = train(2, "host_optimizer")
    losses, trace = train(2, "host_optimizer", batch_numel=4096, trace_step=1)
    assert losses == reference  # bit for bit
    per_layer = ([("copy to host", f"layer{i}")] * 3 + [("wait", f"layer{i}"), ("adam", f"layer{i}"),
                                                         ("copy to device", f"layer{i}")] * 3 for i in range(4))
    # ZeRO 2 steps group by group (the 4 layers, then 'other' on the device): 3 batches per layer of 8416 elements
    assert trace == [op for ops in per_layer for op in ops]


@pytest.mark.parametrize("level", ["host_optimizer", "host_params"])
def test_zero0_copies_every_layer_before_the_first_wait_and_waits_once_per_layer(level):
    reference, _ = train(0, "device")
    losses, trace = train(0, level, trace_step=1)
    assert losses == reference
    layers = [f"layer{i}" for i in range(4)]
    back = [] if level == "host_params" else ["copy to device"]  # host_params: the host params are the master
    assert trace == [("copy to host", n) for n in layers] + [(op, n) for n in layers for op in ["wait", "adam", *back]]


@pytest.mark.parametrize("stage, level, dtype", [(0, "host_optimizer", "fp32"), (0, "host_params", "fp32"),
                                                 (2, "host_params", "fp32"), (1, "host_params", "bf16")])
def test_each_groups_host_buffers_are_one_allocation_per_kind(stage, level, dtype):
    """The pinned allocator rounds every allocation up to a power of two, so the host keeps one flat buffer per
    group and kind, as the planner counts them, with each parameter's tensors views into it."""
    torch.manual_seed(0)
    model = TinyLM()
    cfg = offload_config(stage, level, dtype)
    optimizer, patched, _ = build_offload_optimizer(model, cfg, "layers", 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    loss = engine(*batch(0, 0))
    engine.backward(loss)
    engine.step()
    groups = [g for g in optimizer.param_groups + optimizer.own_param_groups if g["level"] == level]
    assert len(groups) == 4
    for group in groups:
        params = group["params"]
        assert len(params) == 6  # norm, up and down: weight and bias each
        tensors = {"grad": [optimizer.host.grad_buffers[p] for p in params],
                   "exp_avg": [optimizer.state_of(p)["exp_avg"] for p in params],
                   "exp_avg_sq": [optimizer.state_of(p)["exp_avg_sq"] for p in params]}
        if level == "host_params":  # the host params themselves (cast to bf16 by the engine): one per layer too
            tensors["params"] = [optimizer.host_params.host_tensor(p) for p in params]
        if dtype == "bf16":  # the fp32 master beside the bf16 params
            tensors["master"] = [optimizer.host.masters[p] for p in params]
        for kind, views in tensors.items():
            storages = {t.untyped_storage().data_ptr() for t in views}
            assert len(storages) == 1, kind
            width = 2 if kind == "params" and dtype == "bf16" else 4
            assert views[0].untyped_storage().nbytes() == LAYER * width, kind
    engine.destroy()
    optimizer.remove_hooks()
