"""The residency state machine of host_params layers: every layer is on host, fetching, on device or released, each
change goes through one method (traced here), a change the hooks must never make raises, and no copy fetched before
an optimizer step survives it (a layer prefetched by the forward but not run that step would otherwise give the
next step's forward the weights from before the step)."""
import os
import sys

import deepspeed
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch, offload_config  # noqa: E402

from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402
from ds_pseudo_real.offload.params import HostParamStore, Residency  # noqa: E402

H, F, D, R = Residency.ON_HOST, Residency.FETCHING, Residency.ON_DEVICE, Residency.RELEASED
LAYER_BYTES = 8416 * 4


def test_forward_and_backward_take_each_layer_through_the_states_in_order():
    torch.manual_seed(0)
    model = TinyLM(num_layers=2)
    store = HostParamStore(model, "layers", [list(layer.parameters()) for layer in model.layers], trace=True)
    model(*batch(0, 0)).backward()
    assert store.transitions == [
        (0, H, F), (0, F, D), (1, H, F),  # forward: layer 0 runs, layer 1 prefetched
        (0, D, R), (1, F, D), (1, D, R),  # ... layer 1 runs
        (1, R, F), (1, F, D), (0, R, F),  # backward: layer 1, layer 0 prefetched
        (1, D, R), (0, F, D), (0, D, R),  # ... layer 0
    ]
    store.release_all()  # what the optimizer step does first
    assert store.state == [H, H] and store.buffered_bytes == 0
    with pytest.raises(RuntimeError, match="layer 0: on host -> on device is not a residency transition"):
        store._transition(0, D)


class SkipsLastLayerOnEvenSteps(TinyLM):
    """Runs every layer on odd steps and all but the last on even ones: on even steps the forward prefetches the
    last layer and never uses it."""

    step = 0

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers[:len(self.layers) - (self.step % 2 == 0)]:
            h = layer(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def train(level, stage):
    torch.manual_seed(0)
    model = SkipsLastLayerOnEvenSteps()
    cfg = offload_config(stage, level)
    optimizer, patched, _ = build_offload_optimizer(model, cfg, "layers", 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    losses, states = [], []
    for step in range(4):
        model.step = step
        loss = engine(*batch(step, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if optimizer.host_params is not None:
            states.append(list(optimizer.host_params.state))
    engine.destroy()
    return losses, states


@pytest.mark.parametrize("stage", [0, 2])
def test_a_prefetched_layer_the_step_did_not_run_is_dropped_at_the_optimizer_step(stage):
    reference, _ = train("device", stage)
    losses, states = train("host_params", stage)
    assert max(abs(a - b) for a, b in zip(reference, losses)) <= 1e-6, (reference, losses)
    assert states == [[H] * 4] * 4  # nothing fetched across a step


def test_a_torch_without_the_backward_internals_is_refused_naming_them(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    model = TinyLM(num_layers=2)
    with pytest.raises(RuntimeError, match=r"needs torch\._C\._current_graph_task_id"):
        HostParamStore(model, "layers", [list(model.layers[0].parameters())])
