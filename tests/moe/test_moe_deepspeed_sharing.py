"""A stack of DeepSpeed-path M6 MoE layers through the sharing core: pseudo (one set) -> delink -> real.

Single process, ep_size=1: the delinked model computes the same outputs bit for bit, every layer then has its own
experts, and the copies keep DeepSpeed's expert marks (allreduce=False, group_name) that route their gradients.
"""
import deepspeed
import pytest
import torch
from torch import nn

from ds_pseudo_real import sharing
from ds_pseudo_real.moe.deepspeed_layer import ExpertPrototypingMoE


class Stack(nn.Module):
    def __init__(self, layers=3, d=8):
        super().__init__()
        self.layers = nn.ModuleList(ExpertPrototypingMoE(d, nn.Linear(d, d, bias=False), num_experts=4,
                                                         num_prototypes=2, capacity_factor=1.0) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


@pytest.fixture(scope="module", autouse=True)
def distributed():
    """A 1-rank gloo group for DeepSpeed's expert groups. Kept for the rest of the session: DeepSpeed caches the
    expert groups it creates, and a destroyed default group would leave later MoE tests with dead groups."""
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    yield


def test_pseudo_moe_stack_delinks_exactly():
    torch.manual_seed(0)
    model = sharing.apply_sharing(Stack(), "layers", 1)
    for layer in model.layers:
        layer.set_deepspeed_parallelism()
    assert sharing.count_shared_groups(model, "layers") == 1
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        before = model(x)
    sharing.delink_layers(model, "layers")
    with torch.no_grad():
        after = model(x)
    assert torch.equal(before, after)
    experts = [layer.deepspeed_moe.experts.deepspeed_experts[0].weight for layer in model.layers]
    assert len({id(p) for p in experts}) == 3
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in experts)
    assert sharing.count_shared_groups(model, "layers") == 3
