"""In-process delink of a Megatron pseudo GPT (4 layers sharing one set) at iteration 3 of 6, 2 gloo ranks, CPU.

The model is wrapped in Megatron's DDP with overlapped grad reduce and trained with its optimizer (Adam, lr 1e-2,
clip 1.0) through get_forward_backward_func; at the switch the real model is rebuilt, DDP and the optimizer are
rebuilt, and Adam's moments are carried per the copy / scale / reset policy.
"""
import json
from pathlib import Path

import pytest
from conftest import run_two_ranks

WORKERS = Path(__file__).parent / "workers"


def delink(tmp_path, tp, policy, distopt, *extra):
    out = tmp_path / f"{tp}-{policy}-{distopt}-{'-'.join(extra)}.json"
    run_two_ranks(WORKERS / "delink_worker.py", str(out), str(tp), policy, "1" if distopt else "0", *extra)
    r = json.loads(out.read_text())
    assert r["pre_switch_eval"] == r["post_switch_eval"], "the real model must compute exactly what the pseudo did"
    assert r["losses"][3] == r["pre_switch_eval"], "first step after the switch starts from the same loss"
    assert r["moments_ok"] and r["layers_differ"] and r["dp_in_sync"]
    assert r["real_params"] > 2.5 * r["pseudo_params"]
    return r


def test_dp2_copy_distributed_optimizer_and_plain_agree(tmp_path):
    """DP=2: the DistributedOptimizer's sharded moments are gathered and re-sharded so exactly that the run
    matches the same run with the unsharded optimizer; copying keeps the loss falling, resetting makes it jump."""
    dist_opt = delink(tmp_path, 1, "copy", True)
    plain = delink(tmp_path, 1, "copy", False)
    assert dist_opt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
    assert dist_opt["losses"][4] < dist_opt["losses"][3]
    reset = delink(tmp_path, 1, "reset", False)
    assert reset["losses"][:4] == plain["losses"][:4]
    assert reset["losses"][4] > reset["losses"][3] > plain["losses"][4]


def test_tp2_scale_distributed_optimizer(tmp_path):
    r = delink(tmp_path, 2, "scale", True)
    assert r["losses"][5] < r["losses"][3] and r["final_eval"] < r["pre_switch_eval"]


def test_dp2_ep2_m6_moe_each_layer_gets_its_own_experts(tmp_path):
    r = delink(tmp_path, 1, "copy", True, "moe")
    assert r["experts_differ"]
    assert r["final_eval"] < r["pre_switch_eval"]
