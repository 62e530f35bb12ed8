"""The host step one optimizer step late (``granular_offload.host_step: "delayed"``, ZeRO-Offload's delayed parameter
update) is, bit for bit, the sequential step whose forward and backward read the own groups' params of before the
last update: losses and weights, fp32, bf16 and fp16 (a skipped step), clipped, gradient accumulation, a delay from
a later step, 1 and 2 ranks; a resume from a checkpoint continues it exactly; the plan counts what it holds (a
second gradient buffer, and in fp32 a master apart from the host params); and where no layer is stepped by the
offload itself (ZeRO 0 in fp32: host_params and host_optimizer layers in DeepSpeed's optimizer) nothing is delayed."""
from pathlib import Path

import pytest

from case_runs import on_one_rank, on_two_ranks

SCRIPT = Path(__file__).with_name("run_delayed_step.py")
STEPS, SAVE_AFTER, OVERFLOW_AT = 6, 3, 4  # as in the script
ONE_RANK = ["2:fp32:pdpdd", "1:fp32:pdpdd@clip1/from2", "2:bf16:pdpdd", "2:fp16:pdpdd", "2:fp32:ppppd:2",
            "0:fp32:popdd"]
TWO_RANKS = ["2:fp32:pdppd@clip1"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return on_one_rank(SCRIPT, ONE_RANK, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_two_ranks(SCRIPT, TWO_RANKS, tmp_path_factory.mktemp("ckpt2"))


def own_layers(case):
    return case.split(":")[0] != "0" and "p" in case.split(":")[2]


def check(result):
    case = result["case"]
    assert result["delayed"] == result["reference"], "losses differ from the sequential step with stale params"
    assert result["params_equal"], "weights differ from the sequential step with stale params"
    assert result["resumed"] == result["delayed"][-len(result["resumed"]):], "the resumed run left the trajectory"
    assert result["resumed_params_equal"]
    held = result["held"]
    assert held["trained"] == held["plan"]
    if not own_layers(case):  # nothing the offload steps itself: the sequential step, nothing more held
        assert result["counts"] is None and result["delayed"] == result["sequential"]
        assert held["plan"] == result["sequential_plan"]
        return
    start = int(case.partition("/from")[2] or 0)
    skipped = 1 if ":fp16:" in case else 0
    assert result["counts"]["delayed"] == STEPS - start - skipped
    ga = int(case.split("@")[0].split("/")[0].split(":")[3]) if case.count(":") == 3 else 1
    # the first delayed step changes the next step's loss: its forward reads the params of before the update
    first_changed = ga * (start + 1)
    assert result["delayed"][:first_changed] == result["sequential"][:first_changed]
    assert result["delayed"][first_changed:] != result["sequential"][first_changed:]  # (bf16 losses are coarse)
    # a second gradient buffer (4 B a parameter) and, in fp32, a master apart from the host params (4 B), from the
    # start
    extra = (8 if ":fp32:" in case else 4) * result["own_numel"]
    assert held["plan"] - result["sequential_plan"] == extra
    assert held["built"] >= extra


@pytest.mark.parametrize("case", ONE_RANK)
def test_delayed_equals_the_sequential_step_on_stale_params_on_one_rank(one_rank, case):
    check(one_rank[case])


@pytest.mark.parametrize("case", TWO_RANKS)
def test_delayed_equals_the_sequential_step_on_stale_params_on_two_ranks(two_ranks, case):
    results_ = two_ranks[case]
    assert len(results_) == 2
    for result in results_:
        check(result)
    assert results_[0]["delayed"] != results_[1]["delayed"]  # each rank its own batches, one model
