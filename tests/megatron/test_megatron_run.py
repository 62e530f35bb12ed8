"""The drop-in ``python -m megatron_patches.run pretrain_gpt.py <flags> --pseudo-to-real-switch-iter N ...``.

Megatron-LM's training package is not installable here, so these tests run the drop-in on a STAND-IN:
tests/megatron/standin/ holds a small ``megatron.training`` package with the entry points the run module relies on
(pretrain, get_args, setup_model_and_optimizer, train -> train_step, parse_args(extra_args_provider)) and a
``pretrain_gpt.py`` shaped like Megatron-LM's, both built on real megatron.core models, DDP, DistributedOptimizer
and schedules. Passing here shows the patches work against that interface, not against Megatron-LM itself.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_two_ranks

from megatron_patches.run import RELEASE, TRACKER_FILE, checkpoint_to_load, pseudo_stage_at_start

STANDIN = Path(__file__).parent / "standin"
SCRIPT = STANDIN / "pretrain_gpt.py"
RUN = REPO / "megatron_patches" / "run.py"
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{STANDIN}"}
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "0.01"]
M6 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "none",
      "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall", "--m6-expert-prototypes", "2"]
# DP=2, EP=2, DistributedOptimizer, overlapped grad reduce, M6 MoE (4 experts in 2 prototypes), switch at 3.
SWITCHED_M6 = [*TINY, *M6, "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
               "--train-iters", "6", "--pseudo-to-real-switch-iter", "3", "--save-interval", "1"]


def run_one_process(*args):
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_patches.run", str(SCRIPT), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_help_lists_the_flags_with_defaults():
    proc = run_one_process("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    help_text = " ".join(proc.stdout.split())
    assert "--num-layers" in help_text  # Megatron's own flags are still there
    group = help_text.split("pseudo-to-real and M6 (megatron_patches):", 1)[1]
    for flag, default in [("--pseudo-to-real-switch-iter", "Default: None"), ("--pseudo-to-real-groups", "Default: 1"),
                          ("--pseudo-to-real-optimizer-state {copy,reset,scale}", "Default: copy"),
                          ("--m6-expert-prototypes", "Default: None")]:
        assert default in group.split(flag, 1)[1][:400], flag


def test_flag_errors_read_like_megatrons():
    bad_choice = run_one_process(*TINY, "--train-iters", "1", "--pseudo-to-real-optimizer-state", "keep")
    assert bad_choice.returncode == 2
    assert "argument --pseudo-to-real-optimizer-state: invalid choice: 'keep'" in bad_choice.stderr
    bad_groups = run_one_process(*TINY, "--train-iters", "1", "--pseudo-to-real-switch-iter", "2",
                                 "--pseudo-to-real-groups", "3")
    assert bad_groups.returncode != 0
    assert "AssertionError: --pseudo-to-real-groups (3) must be >= 1 and divide --num-layers (4)" in bad_groups.stderr
    usage = subprocess.run([sys.executable, "-m", "megatron_patches.run", "no_such_script.py"], cwd=REPO,
                           env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "SCRIPT 'no_such_script.py' is not a file" in usage.stderr


def run_with_checkpoints(directory: Path) -> list:
    """The user's command: --save and --load name the same directory; returns the per-iteration log."""
    log = directory.parent / f"{directory.name}.json"
    run_two_ranks(RUN, str(SCRIPT), *SWITCHED_M6, "--save", str(directory), "--load", str(directory),
                  "--log-json", str(log), env_extra=ENV)
    return json.loads(log.read_text())


@pytest.fixture(scope="module")
def switched_m6(tmp_path_factory):
    """The uninterrupted run, with a checkpoint after every iteration: (its checkpoint directory, its log)."""
    directory = tmp_path_factory.mktemp("switched_m6") / "checkpoints"
    return directory, run_with_checkpoints(directory)


def test_switch_at_iteration_3_dp2_ep2_m6_moe(switched_m6, tmp_path):
    a = switched_m6[1]
    pseudo_only = tmp_path / "pseudo.json"
    run_two_ranks(RUN, str(SCRIPT), *TINY, *M6, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--overlap-grad-reduce", "--train-iters", "4", "--pseudo-to-real-switch-iter", "100",
                  "--log-json", str(pseudo_only), env_extra=ENV)
    b = json.loads(pseudo_only.read_text())
    # The real model takes over at iteration 3 computing exactly what the pseudo model would have.
    assert [r["loss"] for r in a[:4]] == [r["loss"] for r in b[:4]]
    assert [r["params"] for r in a] == [b[0]["params"]] * 3 + [a[3]["params"]] * 3
    assert a[3]["params"] > 3 * b[0]["params"]
    assert all(r["routers"] == ["ExpertPrototypingRouter"] for r in a)
    assert a[5]["loss"] < a[0]["loss"]


@pytest.mark.parametrize("saved_at", [4, 3, 2], ids=["after-switch", "at-switch", "before-switch"])
def test_relaunch_resumes_in_the_checkpoints_stage(switched_m6, saved_at, tmp_path):
    """A crash right after the checkpoint of iteration ``saved_at`` (switch at 3), then the same command again: it
    resumes in the stage that checkpoint holds (real after the switch; pseudo up to it, delinking at 3), and its
    losses are the uninterrupted run's, bit for bit (fp32, same layout, same batches)."""
    saved, full = switched_m6
    directory = tmp_path / "checkpoints"
    name = f"iter_{saved_at:07d}"
    shutil.copytree(saved / name, directory / name)
    (directory / TRACKER_FILE).write_text(str(saved_at))
    resumed = run_with_checkpoints(directory)
    assert [r["iteration"] for r in resumed] == list(range(saved_at, 6))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[saved_at:]]
    assert [r["params"] for r in resumed] == [r["params"] for r in full[saved_at:]]
    assert (directory / TRACKER_FILE).read_text() == "6"


def test_stage_at_start_follows_the_checkpoint_to_load(tmp_path):
    assert checkpoint_to_load(None) is None
    assert checkpoint_to_load(str(tmp_path)) is None  # --load of an empty directory: a fresh start
    (tmp_path / TRACKER_FILE).write_text("12\n")
    assert checkpoint_to_load(str(tmp_path)) == 12
    assert checkpoint_to_load(str(tmp_path), ckpt_step=8) == 8
    assert checkpoint_to_load(str(tmp_path), ckpt_step=0) == 12  # Megatron reads 0 as "not given"
    # Saved at iteration k = after k steps, before train_step k (where the delink happens) runs.
    assert [pseudo_stage_at_start(10, k) for k in (None, 0, 9, 10, 11, 12)] == [True, True, True, True, False, False]
    assert pseudo_stage_at_start(None, None) is False and pseudo_stage_at_start(None, 5) is False
    (tmp_path / TRACKER_FILE).write_text(RELEASE)
    assert checkpoint_to_load(str(tmp_path)) == RELEASE
    assert pseudo_stage_at_start(None, RELEASE) is False
    with pytest.raises(AssertionError, match="--pseudo-to-real-switch-iter 10 with a 'release' checkpoint"):
        pseudo_stage_at_start(10, RELEASE)
    (tmp_path / TRACKER_FILE).write_text("iter_5")
    with pytest.raises(AssertionError, match=f"{TRACKER_FILE} holds 'iter_5'; expected an iteration or 'release'"):
        checkpoint_to_load(str(tmp_path))


def test_bf16_distributed_optimizer_switch_dp2(tmp_path):
    """Megatron's --bf16 (Float16Module, bf16 DistributedOptimizer with fp32 main weights), moments copied."""
    common = [*TINY, "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--train-iters", "6"]
    switched, pseudo_only = tmp_path / "switched.json", tmp_path / "pseudo.json"
    run_two_ranks(RUN, str(SCRIPT), *common, "--pseudo-to-real-switch-iter", "3",
                  "--pseudo-to-real-optimizer-state", "copy", "--log-json", str(switched), env_extra=ENV)
    run_two_ranks(RUN, str(SCRIPT), *common, "--pseudo-to-real-switch-iter", "100", "--log-json", str(pseudo_only),
                  env_extra=ENV)
    a, b = json.loads(switched.read_text()), json.loads(pseudo_only.read_text())
    assert all(r["dtypes"] == ["torch.bfloat16"] and r["optimizers"] == ["DistributedOptimizer"] for r in a + b)
    assert [r["params"] for r in a] == [b[0]["params"]] * 3 + [a[3]["params"]] * 3
    # At the switch the real model computes what the pseudo model does on the same batch: within one bf16 rounding
    # of the loss (2**-8 relative; the bf16 weights are the same, so it is in fact bit-identical here).
    for real, pseudo in zip(a[:4], b[:4]):
        assert abs(real["loss"] - pseudo["loss"]) <= pseudo["loss"] * 2**-8
    # Then it trains: the data cycles every 2 iterations, so iteration k+2 sees iteration k's batches again; the real
    # model's loss on them falls by 0.1+ (measured ~0.2), and stays at or under the pseudo model's on the same
    # iterations (within one bf16 rounding).
    assert a[4]["loss"] < a[2]["loss"] - 0.1 and a[5]["loss"] < a[3]["loss"] - 0.1
    for real, pseudo in zip(a[4:], b[4:]):
        assert real["loss"] <= pseudo["loss"] * (1 + 2**-8)
