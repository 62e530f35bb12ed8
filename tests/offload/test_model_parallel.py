"""Granular offload under model parallelism, on 2 gloo ranks in one launch (run_model_parallel.py):

- tensor parallel 2 (a Megatron-style mpu through ``ds_pseudo_real.initialize``): each rank plans its own slices,
  counted at their slice size, and trains bit for bit as without offload; with gradient clipping the clip uses the
  whole model's norm (slices summed over the tensor-parallel ranks, replicated parameters counted once).
- pipeline parallel 2 (a DeepSpeed PipelineModule): each stage plans and offloads only its own layers, and trains bit
  for bit as without offload, at ZeRO 0 and 1.
"""
import json
from pathlib import Path

import pytest

from conftest import run_two_ranks

SCRIPT = Path(__file__).with_name("run_model_parallel.py")
CASES = ["tp:1", "tp-clip:1", "pp:0", "pp:1"]
D = 32  # TinyLM's width
# one TinyLM block whole, and the slice of it a rank holds under 2-way tensor parallelism: the norm (2D) and the
# output bias (D) replicated, the up (D x 4D + 4D) and down (4D x D) projections halved
BLOCK = 2 * D + (D * 4 * D + 4 * D) + 4 * D * D + D
BLOCK_SLICE = 2 * D + (D * 4 * D + 4 * D) // 2 + 4 * D * D // 2 + D
EMBEDDING, HEAD = 64 * D, D * 64 + 64


@pytest.fixture(scope="module")
def results():
    proc = run_two_ranks(SCRIPT, *CASES)
    out = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["case"], r["rank"]) for r in out) == sorted((c, r) for c in CASES for r in (0, 1))
    return {(r["case"], r["rank"]): r for r in out}


def _planned_as_held(plan):
    """The host bytes the plan counts for each group are the bytes the offload optimizer holds for it."""
    for name, group in plan.items():
        assert group["held_host"] == group["planned_host"], (name, group)
        assert group["numel"] == group["local_numel"], (name, group)


@pytest.mark.parametrize("case", ["tp:1", "pp:0", "pp:1"])
def test_equal_to_no_offload_in_fp32(results, case):
    for rank in (0, 1):
        result = results[(case, rank)]
        assert result["losses"] == result["ref_losses"], result
        assert result["params_max_diff"] == 0.0, result
        assert result["losses"][0] != result["losses"][-1]  # it trained
        # the reported norm is the whole model's on every rank (ZeRO 0 in fp32 reports none: 0), summed from
        # DeepSpeed's groups and the offload's own: equal to rounding
        assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-6), result


def test_tensor_parallel_plan_counts_each_rank_s_slices(results):
    for rank in (0, 1):
        plan = results[("tp:1", rank)]["plan"]
        _planned_as_held(plan)
        assert {name: (g["numel"], g["level"]) for name, g in plan.items()} == {
            "layer0": (BLOCK_SLICE, "device"), "layer1": (BLOCK_SLICE, "host_params"),
            "layer2": (BLOCK_SLICE, "host_optimizer"), "layer3": (BLOCK_SLICE, "host_params"),
            "other": (EMBEDDING + HEAD, "device")}
        # host_optimizer, ZeRO 1 over one data-parallel rank: master, gradient buffer and two moments of the slice,
        # fp32; half the up and down projections of what the whole block would take
        assert plan["layer2"]["held_host"] == 4 * 4 * BLOCK_SLICE
        assert BLOCK_SLICE < BLOCK * 0.51


def test_tensor_parallel_clips_with_the_whole_model_s_norm(results):
    for rank in (0, 1):
        result = results[("tp-clip:1", rank)]
        assert all(norm > 0.05 for norm in result["ref_norms"]), result  # every step clipped
        assert result["norms"] == pytest.approx(result["ref_norms"], rel=1e-6), result
        # the norm is combined from DeepSpeed's groups and the offload's own: equal to rounding, not bit for bit
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6, abs=0), result
        assert result["params_max_diff"] < 1e-6, result
    assert results[("tp-clip:1", 0)]["norms"] == results[("tp-clip:1", 1)]["norms"]


@pytest.mark.parametrize("case", ["pp:0", "pp:1"])
def test_a_pipeline_stage_plans_only_its_layers(results, case):
    stages = {0: {"layer0": (EMBEDDING, "device"), "layer1": (BLOCK, "host_optimizer"),
                  "layer2": (BLOCK, "host_params")},
              1: {"layer3": (BLOCK, "host_params"), "layer4": (BLOCK, "host_optimizer"), "layer5": (HEAD, "device")}}
    for rank, expected in stages.items():
        plan = results[(case, rank)]["plan"]
        _planned_as_held(plan)
        assert {name: (g["numel"], g["level"]) for name, g in plan.items()} == expected
