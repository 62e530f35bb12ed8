"""The host step during the backward (``granular_offload.host_step: "overlapped"``) equals the host step after it
(``"sequential"``) bit for bit: losses and weights, clipped or not, ZeRO 0-2, fp32, bf16 and fp16, gradient
accumulation, 1 and 2 ranks, and after a resume from a checkpoint; and it did step ahead where it can (own groups:
host_params under ZeRO 1/2), redoing only the steps the norm clipped or the loss scale changed (and holding the step
after such a step sequential), undoing the skipped ones."""
from pathlib import Path

import pytest

from case_runs import on_one_rank, on_two_ranks

SCRIPT = Path(__file__).with_name("run_host_step.py")
STEPS, SAVE_AFTER = 5, 2  # as in the script
LEARNT = 1  # the first optimizer step only counts the gradient flushes
ONE_RANK = ["1:fp32:pdpdd@clip100", "2:fp32:pdpdd@clip1", "2:fp32:ppppd:2/slice256", "2:fp16:pdpdd",
            "2:bf16:pdpdd@clip1", "0:fp32:popdd", "2:fp32:oodod"]
TWO_RANKS = ["1:fp32:pdpdd", "2:fp32:pdppd@clip1"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return on_one_rank(SCRIPT, ONE_RANK, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_two_ranks(SCRIPT, TWO_RANKS, tmp_path_factory.mktemp("ckpt2"))


def check_equal(result):
    assert result["overlapped"] == result["sequential"], "losses of the overlapped host step differ"
    assert result["params_equal"], "weights of the overlapped host step differ"
    assert result["resumed"] == result["sequential"][-len(result["resumed"]):], "the resumed run left the trajectory"
    assert result["resumed_params_equal"]
    assert result["sequential"][0] != result["sequential"][-1]  # it trained


def own_group_steps(result):
    """Group steps the overlapped run could take ahead: every own group at every step but the first."""
    return len(result["own_groups"]) * (STEPS - LEARNT)


@pytest.mark.parametrize("case", ONE_RANK)
def test_overlapped_equals_sequential_on_one_rank(one_rank, case):
    result = one_rank[case]
    check_equal(result)
    if case.startswith("0:") or "p" not in case.split(":")[2]:
        # no own groups: ZeRO 0 in fp32 keeps host_params in DeepSpeed's optimizer; host_optimizer groups are
        # DeepSpeed's; both are stepped after the backward whatever host_step says
        assert result["own_groups"] == [] and result["ahead"] is None
        return
    ahead, groups = result["ahead"], len(result["own_groups"])
    if case.endswith("@clip1") or "@clip1/" in case:
        # every step clips: the first step ahead is redone, and every later step is held sequential
        assert (ahead["stepped_ahead"], ahead["redone"], ahead["held"]) == (groups, groups, STEPS - LEARNT - 1)
    elif "fp16" in case:
        # the scale doubled (window 2) after the first two good steps, so step 2's assumed factor was the old
        # scale's: redone, and step 3 held sequential; step 4 stepped ahead again, skipped (an inf): undone
        assert (ahead["redone"], ahead["held"], ahead["undone"]) == (groups, 1, groups)
        assert ahead["stepped_ahead"] == own_group_steps(result) - groups
    else:
        assert ahead["stepped_ahead"] == own_group_steps(result)
        assert ahead["redone"] == ahead["undone"] == ahead["held"] == 0


@pytest.mark.parametrize("case", ONE_RANK)
def test_the_plan_counts_the_backups_of_the_overlapped_step(one_rank, case):
    """Where a step may be refused (clipping, fp16, bf16's overflow check) the overlapped step keeps copies of what it
    steps ahead: 12 bytes a parameter of the own groups in fp32 (master and moments), 14 in 16 bits (and the host
    params). The plan counts them, and the optimizer holds them from the start."""
    result = one_rank[case]
    dtype, clipped = case.split(":")[1], "@clip" in case
    per_param = (12 if dtype == "fp32" else 14) if (clipped or dtype != "fp32") else 0
    backups = per_param * result["own_numel"]
    sequential, overlapped = result["held"]["sequential"], result["held"]["overlapped"]
    assert (sequential["plan_backups"], overlapped["plan_backups"]) == (0, backups)
    assert overlapped["plan"] - sequential["plan"] == backups
    for held in (sequential, overlapped):
        assert held["trained"] == held["plan"]
    assert overlapped["built"] - sequential["built"] == backups
    if case in ("2:fp32:pdpdd@clip1", "2:fp16:pdpdd"):
        assert backups > 0  # the cases that keep backups do have own groups


@pytest.mark.parametrize("case", TWO_RANKS)
def test_overlapped_equals_sequential_on_two_ranks(two_ranks, case):
    results_ = two_ranks[case]
    assert len(results_) == 2
    for result in results_:
        check_equal(result)
        ahead, groups = result["ahead"], len(result["own_groups"])
        if "@clip1" in case:  # the first step ahead redone, the later ones held sequential
            assert (ahead["stepped_ahead"], ahead["redone"], ahead["held"]) == (groups, groups, STEPS - LEARNT - 1)
        else:
            assert (ahead["stepped_ahead"], ahead["redone"]) == (own_group_steps(result), 0)
