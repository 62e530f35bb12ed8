"""M6 expert-prototyping router in megatron.core's MoELayer (alltoall dispatcher), 2 gloo ranks, CPU.

8 experts in 2 prototypes, capacity factor 1.0 (tokens are dropped), balance loss 0.01. EP=1 is checked against a
direct sum of gated expert outputs; EP=2 (4 experts per rank) against EP=1 with the same weights: same outputs, same
input and router gradients, and expert gradients equal to the EP=1 gradients summed over the two ranks' tokens.
"""
import json
from pathlib import Path

import pytest
from conftest import run_two_ranks

pytestmark = pytest.mark.no_ops  # Megatron's own optimizers: never waits for DeepSpeed's C++ ops

WORKERS = Path(__file__).parent / "workers"


def test_expert_prototyping_ep2_matches_ep1(tmp_path):
    out = tmp_path / "result.json"
    run_two_ranks(WORKERS / "moe_ep_worker.py", str(out))
    r = json.loads(out.read_text())
    assert r["dropped_pairs"] > 0, "the capacity factor should drop some (token, expert) pairs"
    assert r["direct_max_diff"] < 1e-6
    assert r["local_experts_ep2"] == 4
    assert r["output_max_diff"] < 1e-6
    assert r["input_grad_max_diff"] < 1e-6
    assert r["router_grad_max_diff"] < 1e-6
    assert r["expert_grad_abs_mean"] > 1e-3 and r["expert_grad_max_diff"] < 1e-6
