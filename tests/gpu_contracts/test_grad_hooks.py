"""A shared host_params parameter feeds one gradient accumulator per backward, even when the fetch changes its
type: on CUDA every fetch does (host -> device), and torch drops a parameter's accumulator when ``.data`` changes
type, so rebinding the host copy between the layers that share it gave one accumulator, one post-accumulate hook,
one all-reduce and one device-to-host copy per layer. Forced here on the CPU by fetching float64 copies of float32
host params (a type change torch treats the same way)."""
from collections import Counter

import torch
from torch import nn

from ds_pseudo_real.offload import build_offload_optimizer
from ds_pseudo_real.sharing import apply_sharing

D, LAYERS = 8, 4


class Layer(nn.Module):
    """Ops that save the parameters themselves (not views of them) for the backward. A layer's backward reaches
    the weight before the bias; the last layer does not use its bias, so in the backward the weight is ready twice
    before the bias is once."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)
        self.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.uses_bias = True

    def forward(self, x):
        return torch.tanh(((x + self.bias) if self.uses_bias else x) @ self.weight)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.layers[-1].uses_bias = False
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * self.scale).square().sum()


def shared_model():
    torch.manual_seed(0)
    return apply_sharing(Stack(), "layers", 1)


def float64_fetches(store, monkeypatch):
    """Every fetch gives float64 device copies of the float32 host params."""
    fetch = store._copy_to_device

    def copy_to_device(*args):
        tensors, event = fetch(*args)
        return [t.double() for t in tensors], event

    monkeypatch.setattr(store, "_copy_to_device", copy_to_device)


CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "granular_offload": {"levels": {"0": "host_params"}}}


def inputs(seed):
    return torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_a_shared_parameter_gets_one_gradient_per_backward_streamed_once(monkeypatch):
    model = shared_model()
    optimizer, _, plan = build_offload_optimizer(model, CONFIG, "layers", 1)
    float64_fetches(optimizer.host_params, monkeypatch)
    shared = list(model.layers[0].parameters())
    fired = Counter()
    for p in shared:
        p.register_post_accumulate_grad_hook(lambda t: fired.update([id(t)]))
    reference = shared_model().double()
    x = inputs(1)
    reference.scale.data = reference.scale.data.float()  # outside the layers: float32 in both
    reference(x).backward()
    model(x).backward()
    assert sorted(fired.values()) == [1, 1]  # weight and bias: one accumulator each
    own = optimizer.own_gradients
    assert optimizer.moved_bytes == sum(p.numel() * 4 for p in shared)  # one copy to the host
    own.settle()
    expected = [p.grad.float() for p in reference.layers[0].parameters()]
    assert all(torch.equal(own.host.grad_buffers[p], e) for p, e in zip(shared, expected))
    optimizer.zero_gradient_step()  # the host step allocates the moments: every host buffer the plan counts
    held = optimizer.held_bytes_by_group()["layer0"]["host"]
    assert held == next(p.bytes.host for p in plan.placements if p.group.name == "layer0")
    optimizer.remove_hooks()


def test_a_gradient_ready_twice_before_its_group_is_flushed_once(monkeypatch):
    """Two forwards before one backward give a parameter two accumulators (one per forward): its hook fires once
    for each. The second forward does not use the bias, whose hook then fires once, after the weight's second:
    the group is complete when every parameter is ready, and each gradient is flushed once, with everything
    accumulated into it."""

    def two_forwards(model):
        first = model(inputs(1))
        for layer in model.layers:
            layer.uses_bias = False
        (first + model(inputs(2))).backward()

    model = shared_model()
    optimizer, _, _ = build_offload_optimizer(model, CONFIG, "layers", 1)
    float64_fetches(optimizer.host_params, monkeypatch)
    reference = shared_model().double()
    reference.scale.data = reference.scale.data.float()
    two_forwards(reference)
    two_forwards(model)
    own = optimizer.own_gradients
    own.settle()
    expected = [p.grad.float() for p in reference.layers[0].parameters()]
    assert all(torch.allclose(own.host.grad_buffers[p], e, rtol=1e-6, atol=0)
               for p, e in zip(model.layers[0].parameters(), expected))
    optimizer.remove_hooks()
