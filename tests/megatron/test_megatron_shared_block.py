"""Shared-parameter TransformerBlock for megatron.core, on 2 gloo ranks with TP=2 (CPU, cpu_compat installed)."""
import json
from pathlib import Path

import pytest
from conftest import run_two_ranks

pytestmark = pytest.mark.no_ops  # Megatron's own optimizers: never waits for DeepSpeed's C++ ops

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("groups", [2])  # G=1 is covered by the delink tests
def test_shared_block_tp2(tmp_path, groups):
    out = tmp_path / "result.json"
    run_two_ranks(WORKERS / "shared_block_worker.py", str(out), "2", str(groups), str(tmp_path / "ckpt"))
    r = json.loads(out.read_text())
    assert r["pseudo_params"] == r["expected_pseudo_params"] < r["real_params"]
    assert r["layer_numbers"] == [1, 2, 3, 4]
    assert r["groups_found"] == groups
    assert r["meta_params"] == 0 and r["tp_attr_kept"]
    assert r["allocation_saved"] >= r["member_layers_size"], "layers after each group's first allocate no weights"
    assert r["grad_is_sum"]
    assert r["ckpt_real_logits_equal"] and r["ckpt_real_groups"] == 4
    assert r["delink_logits_equal"]
    assert r["delinked_params"] == r["real_params"] and r["delinked_groups"] == 4
    assert r["delinked_tp_attr_kept"]
