"""Pseudo-to-Real on a DeepSpeed MoE model (M6 expert prototyping on deepspeed.moe): after the delink every layer
has its own experts and gate, the loss is continuous, and expert parameters keep DeepSpeed's MoE marks."""
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

import ds_pseudo_real
from ds_pseudo_real.moe.deepspeed_layer import ExpertPrototypingMoE
from ds_pseudo_real.stages import parameter_numel

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from delink_matrix import BeforeDelink, eval_loss, fixed_batch  # noqa: E402


class MoEBlock(nn.Module):
    def __init__(self, hidden, experts, prototypes):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        expert = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.moe = ExpertPrototypingMoE(hidden, expert, num_experts=experts, num_prototypes=prototypes, capacity_factor=2.0)

    def forward(self, x):
        out, _, _ = self.moe(self.norm(x))
        return x + out


class MoELM(nn.Module):
    def __init__(self, hidden=16, layers=4, experts=4, prototypes=2):
        super().__init__()
        self.emb = nn.Embedding(256, hidden)
        self.layers = nn.ModuleList([MoEBlock(hidden, experts, prototypes) for _ in range(layers)])
        self.head = nn.Linear(hidden, 256)

    def forward(self, x, y=None):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return logits if y is None else nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def moe_groups(model):
    return split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()), "name": "all"}])


def test_moe_model_delinks_into_per_layer_experts():
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = MoELM()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "pseudo_to_real": {"switch": {"at_step": 2}}}
    full = sum(p.numel() for p in model.parameters())
    ref = [None]
    before = BeforeDelink(ref, fixed_batch(2))
    engine, *_ = ds_pseudo_real.initialize(model=model, config=cfg, model_parameters=moe_groups, callbacks=[before])
    ref[0] = engine
    x, y = fixed_batch(1)
    losses = []
    for _ in range(4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_steps == 2:
            assert engine.stage == "real"
            assert eval_loss(engine, fixed_batch(2)) == before.seen["loss"]
    layers = engine.module.layers
    first = layers[0].moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight
    second = layers[1].moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight
    assert first is not second and not torch.equal(first, second)  # trained apart after the switch
    assert getattr(second, "allreduce", True) is False  # still marked as an expert parameter
    assert layers[0].moe.deepspeed_moe.gate.wg.weight is not layers[1].moe.deepspeed_moe.gate.wg.weight
    assert parameter_numel(engine.module) == full
    assert engine.last_transition["moments_carried"] == len(list(engine.module.parameters()))
    assert losses[2] < losses[1] + 0.05
    engine.engine.destroy()
