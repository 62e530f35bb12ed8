"""M6 expert-prototyping MoE layer in megatron.core on 2 gloo ranks: EP=2 against EP=1 (experts replicated),
and EP=1 against a direct computation of the k gated expert outputs."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_setup as ms
import torch
import torch.distributed as dist
from megatron.core.transformer.spec_utils import build_module

from ds_pseudo_real.moe import routing
from megatron_patches.moe import m6_layer_spec, m6_moe_config

E, K, CF = 8, 2, 1.0
S, B, H = 8, 2, 64


def run_layer(ep: int, experts_from=None):
    rank = ms.init(ep=ep)
    cfg = ms.config(num_layers=1, ep=ep, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                    **m6_moe_config(E, K, capacity_factor=CF, balance_loss_coeff=0.01))
    torch.manual_seed(0)
    layer = build_module(m6_layer_spec(E, K).submodules.mlp, config=cfg)
    local = E // ep
    if experts_from is not None:
        with torch.no_grad():
            layer.router.weight.copy_(experts_from.router.weight)
            for i, expert in enumerate(layer.experts.local_experts):
                for p, q in zip(expert.parameters(), experts_from.experts.local_experts[rank * local + i].parameters()):
                    p.copy_(q)
    g = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
    x = torch.randn(S, B, H, generator=g).requires_grad_(True)
    weight = torch.randn(S, B, H, generator=g)
    out, _ = layer(x)
    (out * weight).sum().backward()
    return layer, x, out


def main():
    out_path = sys.argv[1]
    full, x1, out1 = run_layer(ep=1)
    rank = dist.get_rank()

    # Direct computation: sum over the kept (token, expert) pairs of gate * expert(token).
    with torch.no_grad():
        tokens = x1.detach().view(-1, H)
        gates, kept = routing.expert_prototype_routing(tokens @ full.router.weight.t(), K, capacity_factor=CF)
        direct = torch.zeros_like(tokens)
        for e, expert in enumerate(full.experts.local_experts):
            direct += gates[:, e:e + 1] * expert(tokens)[0]
    result = {"direct_max_diff": float((out1.detach().view(-1, H) - direct).abs().max()),
              "dropped_pairs": int(tokens.shape[0] * K - kept.sum())}

    grads1 = {n: p.grad.clone() for n, p in full.named_parameters()}
    for grad in grads1.values():  # EP=2 experts see both ranks' tokens: compare with the DP sum
        dist.all_reduce(grad)
    ep2, x2, out2 = run_layer(ep=2, experts_from=full)
    local = E // 2
    expert_diffs = []
    for i, expert in enumerate(ep2.experts.local_experts):
        for name, p in expert.named_parameters():
            expert_diffs.append(float((p.grad - grads1[f"experts.local_experts.{rank * local + i}.{name}"]).abs().max()))
    result.update({
        "local_experts_ep2": len(ep2.experts.local_experts),
        "output_max_diff": float((out1 - out2).abs().max()),
        "input_grad_max_diff": float((x1.grad - x2.grad).abs().max()),
        "router_grad_max_diff": float((full.router.weight.grad - ep2.router.weight.grad).abs().max()),
        "expert_grad_max_diff": max(expert_diffs),
        "expert_grad_abs_mean": float(torch.stack([p.grad.abs().mean() for p in ep2.experts.parameters()]).mean()),
    })
    for key in ("output_max_diff", "input_grad_max_diff", "router_grad_max_diff", "expert_grad_max_diff",
                "direct_max_diff"):
        value = torch.tensor(result[key])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        result[key] = float(value)
    ms.report(out_path, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
