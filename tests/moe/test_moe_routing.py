"""Expert-prototyping routing math against a direct, loop-by-loop computation on fixed inputs."""
import math

import pytest
import torch

from ds_pseudo_real.moe import routing

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops

T, E, K, H = 12, 8, 2, 4  # 12 tokens, 8 experts in 2 prototypes of 4


def fixed_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    x = torch.randn(T, H, generator=g)
    experts = torch.randn(E, H, H, generator=g)  # expert e: x -> x @ W_e
    return logits, x, experts


def direct(logits, x, experts, capacity=None, policy="probs"):
    """Each prototype: softmax over its experts, top-1; per expert keep `capacity` tokens; sum the gated outputs."""
    n = E // K
    picks = []  # (token, expert, gate)
    for t in range(T):
        for p in range(K):
            scores = torch.softmax(logits[t, p * n:(p + 1) * n], dim=0)
            j = int(torch.argmax(scores))
            picks.append((t, p * n + j, float(scores[j])))
    if capacity is not None:
        kept = []
        for e in range(E):
            mine = [pk for pk in picks if pk[1] == e]
            order = sorted(mine, key=lambda pk: -pk[2]) if policy == "probs" else sorted(mine, key=lambda pk: pk[0])
            kept += order[:capacity]
        picks = kept
    out = torch.zeros(T, H)
    for t, e, gate in picks:
        out[t] += gate * (x[t] @ experts[e])
    return out, {(t, e) for t, e, _ in picks}


def moe_output(gates, x, experts):
    return sum(gates[:, e:e + 1] * (x @ experts[e]) for e in range(E))


def test_k_top1_without_capacity():
    logits, x, experts = fixed_inputs()
    gates, routing_map = routing.expert_prototype_routing(logits, K)
    want, pairs = direct(logits, x, experts)
    assert set(map(tuple, routing_map.nonzero().tolist())) == pairs
    assert routing_map.view(T, K, E // K).sum(-1).eq(1).all()  # exactly one expert per prototype
    torch.testing.assert_close(moe_output(gates, x, experts), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_tokens_like_direct(policy):
    logits, x, experts = fixed_inputs()
    capacity = routing.expert_capacity(T, E, K, capacity_factor=1.0)
    assert capacity == math.ceil(T * K / E) == 3
    gates, routing_map = routing.expert_prototype_routing(logits, K, capacity_factor=1.0, drop_policy=policy)
    want, pairs = direct(logits, x, experts, capacity=capacity, policy=policy)
    assert set(map(tuple, routing_map.nonzero().tolist())) == pairs
    assert routing_map.sum() < T * K  # these inputs do overflow some expert
    assert routing_map.sum(0).max() <= capacity
    torch.testing.assert_close(moe_output(gates, x, experts), want, rtol=1e-6, atol=1e-6)


def test_dispatch_combine_reproduces_output():
    logits, x, experts = fixed_inputs()
    gates, routing_map = routing.expert_prototype_routing(logits, K, capacity_factor=1.0)
    combine, dispatch = routing.dispatch_and_combine(gates, routing_map, capacity=3)
    expert_in = torch.einsum("tec,th->ech", dispatch.float(), x)
    expert_out = torch.einsum("ech,ehd->ecd", expert_in, experts)
    out = torch.einsum("tec,ecd->td", combine, expert_out)
    torch.testing.assert_close(out, direct(logits, x, experts, capacity=3)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="capacity"):
        routing.dispatch_and_combine(*routing.expert_prototype_routing(logits, K), capacity=1)


def test_load_balancing_loss_direct_and_uniform():
    logits, _, _ = fixed_inputs()
    _, routing_map = routing.expert_prototype_routing(logits, K)
    n = E // K
    want = 0.0
    for p in range(K):
        scores = torch.softmax(logits[:, p * n:(p + 1) * n], dim=1)
        f = routing_map[:, p * n:(p + 1) * n].float().mean(0)
        want += n * float((f * scores.mean(0)).sum()) / K
    assert routing.load_balancing_loss(logits, routing_map, K).item() == pytest.approx(want, rel=1e-6)
    # Perfectly balanced routing with uniform scores gives exactly 1.
    uniform = torch.zeros(E // K * 2, E)
    balanced = torch.zeros(E // K * 2, E, dtype=torch.bool)
    for t in range(balanced.shape[0]):
        for p in range(K):
            balanced[t, p * n + t % n] = True
    assert routing.load_balancing_loss(uniform, balanced, K).item() == pytest.approx(1.0)


def test_gates_carry_gradient_to_logits():
    logits, x, experts = fixed_inputs()
    logits.requires_grad_(True)
    gates, _ = routing.expert_prototype_routing(logits, K, capacity_factor=1.0)
    moe_output(gates, x, experts).sum().backward()
    assert logits.grad.abs().sum() > 0


def test_bad_prototype_count_names_the_values():
    with pytest.raises(ValueError, match=r"3 prototypes for 8 experts.*\[1, 2, 4, 8\]"):
        routing.expert_prototype_routing(torch.zeros(2, 8), 3)
    with pytest.raises(ValueError, match="drop policy"):
        routing.drop_over_capacity(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bool), 1, "random")


def test_gate_routes_in_fp32_when_the_model_is_cast_to_bf16():
    """DeepSpeed casts the whole model, the gate included, to bf16: the gate still routes on fp32 logits (as
    DeepSpeed's own TopKGate does), from the bf16 input and weight, and its weight gets a gradient."""
    from ds_pseudo_real.moe.deepspeed_layer import ExpertPrototypingGate

    gate = ExpertPrototypingGate(H, E, K, capacity_factor=2.0)
    reference = ExpertPrototypingGate(H, E, K, capacity_factor=2.0)
    gate.to(torch.bfloat16)
    reference.wg.weight.data.copy_(gate.wg.weight.float())
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = gate(x)
    expected = reference(x.float())
    assert all(torch.equal(a, b) for a, b in zip(out[3:], expected[3:]))  # indices, locations, gates, counts
    assert torch.equal(out[0], expected[0])  # l_aux
    out[0].backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.dtype == torch.bfloat16
