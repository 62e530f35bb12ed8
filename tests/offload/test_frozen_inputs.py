"""A host_params layer whose input needs no gradient (frozen embeddings before the first layer): torch fires its
full backward hook before the layer's backward has run, since there is no input gradient to wait for. The layer's
parameters must stay fetched through that backward, and the losses equal those of the same model with every layer
on the device (fp32, <= 1e-6; no clipping, same Adam kernel) while the layer's weights train. On the CPU a released
parameter holds the same values as its fetched copy, so the residency itself is checked: where the layer's backward
reads its weights (a hook on its ``up`` projection), they are the fetched copy, not the host one."""
import os
import sys

import deepspeed
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402
from ds_pseudo_real.offload.params import HostParamStore  # noqa: E402

STEPS = 4


def frozen_embeddings_model():
    torch.manual_seed(0)
    model = TinyLM()
    model.embed.weight.requires_grad_(False)
    return model


def watch_first_layer(model, store):
    """Per backward through layer 0's ``up`` projection: True when its weight is the fetched copy."""
    weight, seen = model.layers[0].up.weight, []

    def record(module, grad_output):
        seen.append(store is not None and weight.data_ptr() != store.host_tensor(weight).data_ptr())

    model.layers[0].up.register_full_backward_pre_hook(record)
    return seen


def test_the_store_keeps_the_first_layer_fetched_through_its_backward():
    model = frozen_embeddings_model()
    store = HostParamStore(model, "layers", [list(model.layers[i].parameters()) for i in (0, 1)])
    seen = watch_first_layer(model, store)
    model(*batch(0, 0)).backward()
    assert seen == [True], "layer 0 was released before its backward"
    assert all(p.grad is not None for p in model.layers[0].parameters())
    assert store.buffered_bytes == 0  # released by the end of the backward
    assert store.peak_buffered_bytes == 2 * 8416 * 4


def train(stage, level):
    model = frozen_embeddings_model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "granular_offload": {"levels": {"0": level, "1": level}}}
    optimizer, patched, _ = build_offload_optimizer(model, cfg, "layers", 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    seen = watch_first_layer(model, optimizer.host_params)
    first = model.layers[0].up.weight
    losses, weights = [], [first.detach().clone()]
    for step in range(STEPS):
        loss = engine(*batch(step, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        weights.append(first.detach().clone())
    embeddings = model.embed.weight.detach().clone()
    engine.destroy()
    optimizer.remove_hooks()
    return losses, weights, seen, embeddings


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_host_params_first_layer_after_frozen_embeddings_trains_as_on_the_device(stage):
    reference, reference_weights, _, reference_embeddings = train(stage, "device")
    losses, weights, seen, embeddings = train(stage, "host_params")
    assert seen == [True] * STEPS, "layer 0 was released before its backward"
    assert max(abs(a - b) for a, b in zip(reference, losses)) <= 1e-6, (reference, losses)
    assert all(not torch.equal(a, b) for a, b in zip(weights, weights[1:])), "layer 0 did not train"
    assert (weights[-1] - reference_weights[-1]).abs().max() <= 1e-6
    assert torch.equal(embeddings, reference_embeddings)
    assert torch.equal(embeddings, frozen_embeddings_model().embed.weight)  # frozen: never stepped
