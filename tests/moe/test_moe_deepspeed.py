"""M6 expert prototyping on deepspeed.moe (CPU, 2 gloo ranks): 8 experts in 2 prototypes, capacity factor 1.0.

ep_size=1 is checked against a direct sum of gated expert outputs; ep_size=2 against ep_size=1 with the same
weights (outputs, input and gate gradients equal; expert gradients equal to the ep_size=1 ones summed over ranks);
then a ZeRO-1 DeepSpeed engine with ep_size=2 trains 8 steps.
"""
import json
from pathlib import Path

from conftest import run_two_ranks

WORKERS = Path(__file__).parent / "workers"


def test_deepspeed_expert_prototyping_ep2(tmp_path):
    out = tmp_path / "result.json"
    run_two_ranks(WORKERS / "ds_moe_ep_worker.py", str(out))
    r = json.loads(out.read_text())
    assert r["dropped_pairs"] > 0
    assert r["direct_max_diff"] < 1e-6
    assert r["local_experts_ep2"] == 4
    assert r["output_max_diff"] < 1e-6 and r["input_grad_max_diff"] < 1e-6 and r["gate_grad_max_diff"] < 1e-6
    assert r["expert_grad_max_diff"] < 1e-5
    losses = r["engine_losses"]
    assert r["has_moe_layers"] and r["dense_in_sync"]
    assert losses[-1] < 0.75 * losses[0], losses
