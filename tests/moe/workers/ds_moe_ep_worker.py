"""ExpertPrototypingMoE on deepspeed.moe, 2 gloo ranks: ep_size=2 against ep_size=1, then a DeepSpeed engine."""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from ds_pseudo_real.moe import routing
from ds_pseudo_real.moe.deepspeed_layer import ExpertPrototypingMoE

E, K, CF, D = 8, 2, 1.0, 16


def expert():
    return nn.Sequential(nn.Linear(D, 2 * D, bias=False), nn.ReLU(), nn.Linear(2 * D, D, bias=False))


def layer(ep_size, source=None):
    torch.manual_seed(0)
    moe = ExpertPrototypingMoE(D, expert(), num_experts=E, num_prototypes=K, ep_size=ep_size, capacity_factor=CF)
    moe.set_deepspeed_parallelism()
    if source is not None:
        rank, local = dist.get_rank(), E // ep_size
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(source.deepspeed_moe.gate.wg.weight)
            for i, mine in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                for p, q in zip(mine.parameters(), source.deepspeed_moe.experts.deepspeed_experts[rank * local + i].parameters()):
                    p.copy_(q)
    return moe


def forward_backward(moe):
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(2, 8, D, generator=g).requires_grad_(True)
    weight = torch.randn(2, 8, D, generator=g)
    out, l_aux, _ = moe(x)
    ((out * weight).sum() + 0.1 * l_aux).backward()
    return x, out


class TinyMoEModel(nn.Module):
    def __init__(self, ep_size, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.moe = ExpertPrototypingMoE(D, expert(), num_experts=E, num_prototypes=K, ep_size=ep_size,
                                        capacity_factor=CF)
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        out, l_aux, _ = self.moe(h)
        logits = self.head(h + out)
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)) + 0.01 * l_aux


def main():
    out_path = sys.argv[1]
    sys.argv = sys.argv[:1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    full = layer(ep_size=1)
    x1, out1 = forward_backward(full)

    with torch.no_grad():  # direct: sum of the kept gated expert outputs
        tokens = x1.detach().view(-1, D)
        gates, kept = routing.expert_prototype_routing(full.deepspeed_moe.gate.wg(tokens), K, capacity_factor=CF)
        direct = sum(gates[:, e:e + 1] * full.deepspeed_moe.experts.deepspeed_experts[e](tokens) for e in range(E))
    result = {"direct_max_diff": float((out1.detach().view(-1, D) - direct).abs().max()),
              "dropped_pairs": int(tokens.shape[0] * K - kept.sum())}

    grads1 = [[p.grad.clone() for p in ex.parameters()] for ex in full.deepspeed_moe.experts.deepspeed_experts]
    for per_expert in grads1:
        for grad in per_expert:
            dist.all_reduce(grad)  # with ep_size=2 an expert sees both ranks' tokens
    ep2 = layer(ep_size=2, source=full)
    x2, out2 = forward_backward(ep2)
    diffs = [float((p.grad - q).abs().max())
             for i, ex in enumerate(ep2.deepspeed_moe.experts.deepspeed_experts)
             for p, q in zip(ex.parameters(), grads1[rank * (E // 2) + i])]
    result.update({
        "local_experts_ep2": len(ep2.deepspeed_moe.experts.deepspeed_experts),
        "output_max_diff": float((out1 - out2).abs().max()),
        "input_grad_max_diff": float((x1.grad - x2.grad).abs().max()),
        "gate_grad_max_diff": float((full.deepspeed_moe.gate.wg.weight.grad - ep2.deepspeed_moe.gate.wg.weight.grad).abs().max()),
        "expert_grad_max_diff": max(diffs),
    })

    # A DeepSpeed engine (ZeRO-1) with ep_size=2 trains: the loss falls, the dense weights stay equal across ranks.
    torch.manual_seed(1)
    model = TinyMoEModel(ep_size=2)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6})
    g = torch.Generator().manual_seed(7 + rank)
    batch = torch.randint(0, 64, (4, 8), generator=g)
    losses = []
    for _ in range(8):
        loss = engine(batch, torch.roll(batch, -1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    head = model.head.weight.detach().clone()
    dist.all_reduce(head)
    result.update({"engine_losses": losses, "has_moe_layers": bool(engine.has_moe_layers),
                   "dense_in_sync": bool(torch.allclose(head / 2, model.head.weight, atol=1e-6))})

    for key in ("direct_max_diff", "output_max_diff", "input_grad_max_diff", "gate_grad_max_diff", "expert_grad_max_diff"):
        value = torch.tensor(result[key])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        result[key] = float(value)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)
    dist.barrier()  # both ranks out of every collective before the groups (DeepSpeed's expert groups too) go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
