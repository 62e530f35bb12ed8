"""In-process delink with DeepSpeed: the loss is continuous across the switch for ZeRO 0-3, fp32 and bf16, on
1 rank and on 2 gloo ranks; the fp32 masters and the optimizer-state policy are carried exactly and the Adam step
count continues."""
import json
import sys
from pathlib import Path

import deepspeed
import pytest
import torch

from conftest import run_two_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import delink_matrix  # noqa: E402



def check(result):
    tag = f"ZeRO-{result['stage']} {result['dtype']} {result['policy']}"
    if result["dtype"] == "fp32":
        assert result["pre"] == result["post"], f"{tag}: loss changed across the delink {result['pre']} -> {result['post']}"
    else:
        assert abs(result["pre"] - result["post"]) <= 2**-7 * abs(result["pre"]), f"{tag}: {result}"
    assert result["moments_ok"], f"{tag}: optimizer state not carried per policy"
    # The real model's fp32 masters are the pseudo masters, not their rounding to the working dtype.
    assert not result["masters_differ"], f"{tag}: fp32 masters not carried exactly: {result['masters_differ'][:3]}"
    # The step counter continues from the pseudo optimizer's (bias correction unchanged); reset starts over.
    assert result["adam_step"] == (None if result["policy"] == "reset" else result["pseudo_adam_step"]), tag
    assert result["pseudo_adam_step"] is not None and result["pseudo_adam_step"] >= delink_matrix.SWITCH, tag
    assert result["final_stage"] == "real" and result["global_steps"] == delink_matrix.SWITCH + 3, tag
    expected_params = sum(p.numel() for p in delink_matrix.tiny_gpt().parameters())
    assert result["params_after"] == expected_params, tag


@pytest.mark.parametrize("case", delink_matrix.matrix(), ids=lambda c: "-".join(map(str, c)))
def test_delink_single_rank(case):
    check(delink_matrix.run_case(*case))


def test_delink_reset_policy_starts_fresh_moments():
    result = delink_matrix.run_case(1, "fp32", "reset")
    assert result["pre"] == result["post"]
    assert result["moments_ok"] and result["adam_step"] is None


def test_delink_two_ranks():
    proc = run_two_ranks(Path(__file__).parent / "scripts" / "delink_matrix.py", timeout=900)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(delink_matrix.matrix())
    for result in results:
        check(result)


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_delink_builds_the_real_model_in_the_working_dtype(stage, dtype, monkeypatch):
    """ZeRO 1/2: every rank builds the whole real model before DeepSpeed takes it, in the dtype it trains in, so that
    in bf16 the host never holds the real model in fp32 (half the bytes)."""
    handed = []
    initialize = deepspeed.initialize

    def recording(*args, model, **kwargs):
        handed.append({p.dtype for p in model.parameters()})
        return initialize(*args, model=model, **kwargs)

    monkeypatch.setattr(deepspeed, "initialize", recording)
    result = delink_matrix.run_case(stage, dtype, "copy")
    check(result)
    assert len(handed) == 2  # the pseudo model as given, then the real model the delink built
    assert handed[1] == {torch.bfloat16 if dtype == "bf16" else torch.float32}
