"""In-process delink of a Megatron pseudo GPT (4 layers sharing one set) at iteration 3 of 6, 2 gloo ranks, CPU.

The model is wrapped in Megatron's DDP with overlapped grad reduce and trained with its optimizer (Adam, lr 1e-2
dense / 3e-3 MoE, clip 1.0) through get_forward_backward_func; at the switch the real model is rebuilt, DDP and
the optimizer are rebuilt, and every real parameter's fp32 master, Adam moments and step are checked exactly
against the shared parameter it came from under the copy / scale / reset policy. Optimizers covered:
DistributedOptimizer, FP32Optimizer, Float16OptimizerWithFloat16Params (bf16, fp16); MoE with EP=2 and with TP=2 +
sequence parallelism (experts TP-split, or expert-parallel with token dropping).
"""
import json
from pathlib import Path

import pytest
from conftest import run_two_ranks

pytestmark = pytest.mark.no_ops  # Megatron's own optimizers: never waits for DeepSpeed's C++ ops

WORKERS = Path(__file__).parent / "workers"


SCENARIOS = {"dp2-copy-distopt": "1:copy:1", "dp2-copy-plain": "1:copy:0", "dp2-reset-plain": "1:reset:0",
             "tp2-scale-distopt": "2:scale:1",
             "dp2-copy-bf16": "1:copy:0:bf16", "tp2-scale-bf16": "2:scale:0:bf16", "dp2-copy-fp16": "1:copy:0:fp16",
             "dp2-ep2-moe-copy-distopt": "1:copy:1:moe:ep2", "dp2-ep2-moe-scale-distopt": "1:scale:1:moe:ep2",
             "dp2-ep2-moe-noswitch": "1:copy:1:moe:ep2:noswitch",
             "tp1-moe-copy": "1:copy:1:moe:samedata", "tp2-sp-etp2-moe-copy": "2:copy:1:moe:samedata",
             "tp1-ep2-moe-drop-copy": "1:copy:1:moe:ep2:drop:samedata",
             "tp2-sp-ep2-moe-drop-copy": "2:copy:1:moe:ep2:drop:samedata",
             "dp2-copy-distopt-groupstep": "1:copy:1:groupstep", "dp2-copy-bf16-groupstep": "1:copy:0:bf16:groupstep"}
SWITCHED = [name for name in SCENARIOS if not name.endswith("noswitch")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All scenarios in one 2-rank job (the job start dominates their cost on this machine)."""
    out = tmp_path_factory.mktemp("delink") / "result.json"
    run_two_ranks(WORKERS / "delink_worker.py", str(out), *SCENARIOS.values())
    results = json.loads(out.read_text())
    return {name: results[scenario] for name, scenario in SCENARIOS.items()}


@pytest.mark.parametrize("name", SWITCHED)
def test_same_loss_across_the_switch(runs, name):
    r = runs[name]
    assert r["pre_switch_eval"] == r["post_switch_eval"], "the real model must compute exactly what the pseudo did"
    assert r["losses"][3] == r["pre_switch_eval"], "first step after the switch starts from the same loss"
    assert r["state_mismatches"] == [] and r["states_checked"] >= 49 and r["members_max"] == 4
    assert r["layers_differ"] and r["dp_in_sync"]
    assert r["real_params"] > 2.5 * r["pseudo_params"]


def test_dp2_copy_distributed_optimizer_and_plain_agree(runs):
    """DP=2: the DistributedOptimizer's sharded moments are gathered and re-sharded so exactly that the run
    matches the same run with the unsharded optimizer; copying keeps the loss falling, resetting makes it jump."""
    dist_opt, plain, reset = runs["dp2-copy-distopt"], runs["dp2-copy-plain"], runs["dp2-reset-plain"]
    assert dist_opt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
    assert dist_opt["losses"][4] < dist_opt["losses"][3]
    assert reset["losses"][:4] == plain["losses"][:4]
    assert reset["losses"][4] > reset["losses"][3] > plain["losses"][4]


@pytest.mark.parametrize("name", ["dp2-copy-distopt", "dp2-copy-bf16"])
def test_delink_carries_a_step_count_kept_in_the_param_groups(runs, name):
    """Where Transformer Engine or apex is installed (a GPU machine), Megatron's Adam is their FusedAdam, which keeps
    the step count in each param group. The delink must carry it from there: the same run with an optimizer that
    does so (torch's AdamW arithmetic, the count in the groups) trains exactly as with torch's AdamW."""
    torch_count, group_count = runs[name], runs[name + "-groupstep"]
    assert group_count["torch_optimizer"] == "GroupStepAdamW" and torch_count["torch_optimizer"] == "AdamW"
    assert group_count["losses"] == torch_count["losses"]
    assert group_count["final_eval"] == torch_count["final_eval"]


def test_tp2_scale_distributed_optimizer(runs):
    r = runs["tp2-scale-distopt"]
    assert r["losses"][5] < r["losses"][3] and r["final_eval"] < r["pre_switch_eval"]


@pytest.mark.parametrize("name", ["dp2-copy-bf16", "tp2-scale-bf16", "dp2-copy-fp16"])
def test_float16_optimizer_carries_masters_and_moments(runs, name):
    """Megatron's bf16/fp16 optimizer without DistributedOptimizer: masters and moments live on its fp32 copies
    (checked exactly for every parameter above); fp16's dynamic loss scale (grown from 1024) carries over."""
    r = runs[name]
    assert r["optimizer"] == "Float16OptimizerWithFloat16Params"
    assert r["losses"][4] < r["losses"][3] and r["final_eval"] < r["pre_switch_eval"]
    assert r["loss_scale_post"] == r["loss_scale_pre"] == (2048.0 if name.endswith("fp16") else 1.0)


def test_dp2_ep2_m6_moe_each_layer_gets_its_own_experts(runs):
    r = runs["dp2-ep2-moe-copy-distopt"]
    assert r["experts_differ"] and r["carried_nonzero"]
    assert r["final_eval"] < r["pre_switch_eval"]


def test_moe_delink_follows_the_pseudo_run(runs):
    """The first step after an MoE delink moves the loss as the pseudo model's own next step does (it fell
    3.868 -> 3.647 with copy, 3.625 with no switch at all): copying the summed moments does not inflate Adam's
    update, which is invariant to their common scale; per kind of parameter copy and scale differ by < 10%.
    The rise once seen at lr 1e-2 (4.136 -> 5.152) is the pseudo model's own (5.164 with no switch); reproduce with
    ``torchrun --nproc_per_node 2 tests/megatron/workers/delink_worker.py out.json 1:copy:1:moe:ep2:lr0.01
    1:copy:1:moe:ep2:lr0.01:noswitch 1:scale:1:moe:ep2:lr0.01 1:reset:1:moe:ep2:lr0.01``."""
    copy, scale, control = (runs[n] for n in ("dp2-ep2-moe-copy-distopt", "dp2-ep2-moe-scale-distopt",
                                               "dp2-ep2-moe-noswitch"))
    assert copy["losses"][:4] == control["losses"][:4]
    for r in (copy, scale):
        assert r["losses"][4] < r["losses"][3]
        assert abs(r["losses"][4] - control["losses"][4]) < 0.05
    for kind in ("experts", "router", "dense", "layer_norm"):
        assert 0.9 < copy["first_update_norm"][kind] / scale["first_update_norm"][kind] < 1.1, kind


@pytest.mark.parametrize("tp1, tp2", [("tp1-moe-copy", "tp2-sp-etp2-moe-copy"),
                                      ("tp1-ep2-moe-drop-copy", "tp2-sp-ep2-moe-drop-copy")])
def test_moe_tp2_sequence_parallel_matches_tp1(runs, tp1, tp2):
    """Same weights and data (every DP rank gets the same batch): TP=2 with sequence parallelism trains and
    delinks as TP=1 does, up to the order of the tensor-parallel reductions (relative 1e-6). Experts TP-split
    (ETP=2), or split over the ranks (EP=2) with capacity 1.0 dropping tokens and a balance loss: the router
    routes the whole sequence, not each rank's slice."""
    a, b = runs[tp1], runs[tp2]
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-6, abs=0)
    assert b["final_eval"] == pytest.approx(a["final_eval"], rel=1e-6, abs=0)
    assert b["losses"][4] < b["losses"][3]
