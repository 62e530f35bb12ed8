"""In-process delink with DeepSpeed: the loss is continuous across the switch for ZeRO 0-3, fp32 and bf16, on
1 rank and on 2 gloo ranks; the fp32 masters and the optimizer-state policy are carried exactly and the Adam step
count continues."""
import json
import re
import sys
from pathlib import Path

import deepspeed
import pytest
import torch

from conftest import run_two_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import delink_matrix  # noqa: E402

check = delink_matrix.check


@pytest.mark.parametrize("case", delink_matrix.matrix(), ids=lambda c: "-".join(map(str, c)))
def test_delink_single_rank(case):
    check(delink_matrix.run_case(*case))


def test_delink_reset_policy_starts_fresh_moments():
    result = delink_matrix.run_case(1, "fp32", "reset")
    assert result["pre"] == result["post"]
    assert result["moments_ok"] and result["adam_step"] is None


@pytest.mark.parametrize("policy", ["copy", "scale"])
def test_delink_continues_the_step_count_of_deepspeeds_fused_adam(policy):
    """DeepSpeed's FusedAdam (its "AdamW" without ``torch_adam``) counts steps in the state of the last parameter of
    each group it steps. At ZeRO 0 it steps the model's parameters one by one, so the first state's count says 0:
    read from there, the real model's first step ran with step-1 bias correction on the carried moments. The run
    must train as under ZeRO 1, where one flat tensor per group holds the count: the same losses, bit for bit."""
    zero0, zero1 = (delink_matrix.run_case(stage, "fp32", policy, torch_adam=False) for stage in (0, 1))
    assert zero0["optimizer"] == zero1["optimizer"] == "FusedAdam"
    assert zero0["pseudo_adam_step"] == zero1["pseudo_adam_step"] == delink_matrix.SWITCH
    check(zero0)
    check(zero1)
    assert zero0["losses"] == zero1["losses"]


def test_delink_two_ranks():
    """Each rank holds part of every flat partition: the moments the delink leaves unfilled (NaN here) are written
    or zeroed on both, partition boundaries and the last rank's padding included."""
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "delink_matrix.py", "--poison-unfilled", timeout=900)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(delink_matrix.matrix())
    for result in results:
        check(result)


def test_delink_three_ranks():
    """On 3 ranks every parameter's element count leaves the last partitions padded (ZeRO 1-3): each case of the
    matrix is checked on every rank (``--check``: the exit status says whether one failed)."""
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "delink_matrix.py", "--poison-unfilled", "--check",
                         timeout=900, ranks=3)
    passed = set(re.findall(r"rank (\d) ok: (\([^)]*\))", proc.stdout))  # the ranks' lines may interleave
    assert passed == {(str(rank), str(case)) for rank in range(3) for case in delink_matrix.matrix()}


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_delink_builds_the_real_model_in_the_working_dtype(stage, dtype, monkeypatch):
    """ZeRO 1/2: every rank builds the whole real model before DeepSpeed takes it, in the dtype it trains in, so that
    in bf16 the host never holds the real model in fp32 (half the bytes)."""
    handed = []
    initialize = deepspeed.initialize

    def recording(*args, model, **kwargs):
        handed.append({(p.dtype, p.device.type) for p in model.parameters()})
        return initialize(*args, model=model, **kwargs)

    monkeypatch.setattr(deepspeed, "initialize", recording)
    result = delink_matrix.run_case(stage, dtype, "copy")
    check(result)
    assert len(handed) == 2  # the pseudo model as given, then the real model the delink built
    assert handed[1] == {(torch.bfloat16 if dtype == "bf16" else torch.float32, "cpu")}  # where it trains, here
