"""benchmarks/offload.py on CPU: the granular arm's losses equal the no-offload arm's and its bytes equal the plan,
also with each layer checkpointed, 2 micro-batches per step and a step DeepSpeed skips."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SMALL = ["--layers", "3", "--d-model", "32", "--steps", "2", "--warmup", "1"]
HOST_PARAMS = ["--device-memory", "500KB", "--max-level", "host_params", "--gradient-clipping", "0"]
HELD = ("optimizer_device", "optimizer_host")


def run_benchmark(tmp_path, *flags):
    out = tmp_path / "offload.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "benchmarks/offload.py", *flags, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if proc.returncode == 0 else None


def arm(report, name):
    return next(r for r in report["results"] if r["arm"] == name)


@pytest.mark.parametrize("flags, levels", [
    (["--device-memory", "980KB"], {"host_optimizer", "device"}),
    # ZeRO 2 with layers at host_params, outside DeepSpeed's optimizer (exact without clipping)
    (HOST_PARAMS, {"host_optimizer", "host_params"}),
], ids=["host_optimizer", "host_params"])
def test_cpu_benchmark_reports_exactness_and_accounting(tmp_path, flags, levels):
    proc, report = run_benchmark(tmp_path, *SMALL, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    granular = arm(report, "granular")
    assert set(granular["plan"]["levels"].values()) == levels
    measured, predicted = granular["plan"]["measured"], granular["plan"]["predicted"]
    assert {k: measured[k] for k in (*HELD, "moved_per_step")} == {k: predicted[k] for k in (*HELD, "moved_per_step")}
    assert measured["moved_per_step"] == sum(measured["moved_per_step_parts"].values())
    assert report["summary"]["granular_losses_equal_none"] is True
    assert report["summary"]["accounting_equal_plan"] is True
    assert report["summary"]["step_time_over_granular"]["granular"] == 1.0
    assert "granular_losses_equal_none: True" in proc.stdout


def test_checkpointed_layers_at_host_params_with_accumulation_and_a_skipped_step(tmp_path):
    """The recompute of a checkpointed host_params layer, 2 micro-batches per step and an inf gradient at step 2:
    every micro-batch's loss equals the no-offload arm's, and both arms skip that one step."""
    steps, accumulation, skipped = 4, 2, 2
    proc, report = run_benchmark(tmp_path, *SMALL, "--steps", str(steps - 1), *HOST_PARAMS, "--gradient-accumulation",
                                 str(accumulation), "--checkpoint-activations", "non-reentrant",
                                 "--skip-step", str(skipped))
    assert proc.returncode == 0, proc.stderr[-3000:]
    none, granular = arm(report, "none"), arm(report, "granular")
    assert set(granular["plan"]["levels"].values()) == {"host_optimizer", "host_params"}
    assert len(granular["losses"]) == steps * accumulation
    assert granular["losses"] == none["losses"]
    assert none["skipped_steps"] == granular["skipped_steps"] == 1
    assert granular["poisoned_parameter"] == none["poisoned_parameter"] == "layers.1.ln1.weight"
    assert report["summary"]["skip_step_skipped_by_every_arm"] is True
    assert report["summary"]["granular_losses_equal_none"] is True
    measured, predicted = granular["plan"]["measured"], granular["plan"]["predicted"]
    assert {k: measured[k] for k in HELD} == {k: predicted[k] for k in HELD}
    assert "skip_step_skipped_by_every_arm: True" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--skip-step", "3"], "--skip-step: got 3; accepted: 0 to 2"),
    (["--gradient-accumulation", "0"], "--gradient-accumulation: got 0; accepted: an integer >= 1"),
    (["--checkpoint-activations", "full"], "invalid choice: 'full'"),
])
def test_flags_out_of_range_are_refused_with_what_is_accepted(tmp_path, flags, message):
    proc, _ = run_benchmark(tmp_path, *SMALL, *flags)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_check_fails_on_an_arm_that_did_not_run_bytes_off_the_plan_an_unskipped_inf_or_losses_apart():
    """``--check`` (what the GPU check runs): on the CPU the losses must be equal; where the arms round differently
    (on CUDA, or bf16 with gradient accumulation) within ``LOSS_TOLERANCE`` of the loss."""
    sys.path.insert(0, str(REPO))
    from benchmarks.offload import check_failures, parse_args, report

    def results(granular_losses, **granular):
        none = {"arm": "none", "losses": [5.0, 4.0], "step_s_median": 1.0, "peak_device_bytes": None,
                "skipped_steps": 1}
        return [none, {"arm": "granular", "losses": granular_losses, "step_s_median": 1.0, "peak_device_bytes": None,
                       "skipped_steps": 1, "plan": {"measured": {k: 1 for k in (*HELD, "moved_per_step")},
                                                    "predicted": {k: 1 for k in (*HELD, "moved_per_step")}},
                       **granular}]

    def failures(runs, flags=(), cuda=False):
        args = parse_args([*SMALL, *flags])
        return check_failures(runs, report(runs, args.skip_step), args, cuda)

    assert failures(results([5.0, 4.0])) == []
    assert failures(results([5.0, 4.0 + 1e-6])) == ["granular losses differ from no offload's by 1e-06 (allowed 0)"]
    assert failures(results([5.0, 4.0 + 1e-6]), cuda=True) == []  # 1e-4 x 5.0 on CUDA in fp32
    bf16_accumulated = ["--bf16", "--gradient-accumulation", "2"]
    assert failures(results([5.0, 4.0 + 8e-5]), bf16_accumulated) == []  # 1e-3 x 5.0
    assert failures(results([5.0, 4.1]), bf16_accumulated) == [
        "granular losses differ from no offload's by 0.1 (allowed 0.005)"]
    broken = results([5.0, 4.0], skipped_steps=0)
    broken[1]["plan"]["measured"]["optimizer_host"] = 2
    assert failures(broken, ["--skip-step", "1"]) == [
        "the granular optimizer's held or moved bytes differ from the plan's",
        "the inf gradient of step 1 was not skipped by every arm: {'none': 1, 'granular': 0}"]
    assert failures([results([5.0])[0], {"arm": "granular", "error": "exit 1: ['PlanError']"}]) == [
        "arm granular: exit 1: ['PlanError']"]


def test_the_no_offload_arm_on_cuda_asks_deepspeed_for_torchs_fused_adamw(monkeypatch):
    """On CUDA the no-offload arm steps with torch's fused AdamW, the kernel of the granular arm's device groups, not
    DeepSpeed's FusedAdam, which would be built with nvcc inside a capped step of the GPU check. Built here on the CPU
    (torch's fused AdamW runs there too) with CUDA reported to the benchmark."""
    import torch

    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import offload

    args = offload.parse_args([*SMALL, "--device-memory", "1MB"])
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        engine, optimizer, plan = offload.build_arm("none", args)
    try:
        inner = engine.optimizer.optimizer  # ZeRO's wrapper around the optimizer DeepSpeed built from the config
        assert (type(inner), inner.defaults["fused"], optimizer, plan) == (torch.optim.AdamW, True, None, None)
    finally:
        engine.destroy()
