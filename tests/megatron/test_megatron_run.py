"""The drop-in ``python -m megatron_patches.run pretrain_gpt.py <flags> --pseudo-to-real-switch-iter N ...``.

Megatron-LM's training package is not installable here, so these tests run the drop-in on a STAND-IN:
tests/megatron/standin/ holds a small ``megatron.training`` package with the entry points the run module relies on
(pretrain, get_args, setup_model_and_optimizer, train -> train_step, parse_args(extra_args_provider)) and a
``pretrain_gpt.py`` shaped like Megatron-LM's, both built on real megatron.core models, DDP, DistributedOptimizer
and schedules. Passing here shows the patches work against that interface, not against Megatron-LM itself.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_two_ranks

STANDIN = Path(__file__).parent / "standin"
SCRIPT = STANDIN / "pretrain_gpt.py"
RUN = REPO / "megatron_patches" / "run.py"
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{STANDIN}"}
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "0.01"]
M6 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "none",
      "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall", "--m6-expert-prototypes", "2"]


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


def test_switch_at_iteration_3_dp2_ep2_m6_moe(tmp_path):
    """DP=2, EP=2, DistributedOptimizer, overlapped grad reduce, M6 MoE (4 experts in 2 prototypes)."""
    common = [*TINY, *M6, "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    switched, pseudo_only = tmp_path / "switched.json", tmp_path / "pseudo.json"
    run_two_ranks(RUN, str(SCRIPT), *common, "--train-iters", "6", "--pseudo-to-real-switch-iter", "3",
                  "--log-json", str(switched), env_extra=ENV)
    run_two_ranks(RUN, str(SCRIPT), *common, "--train-iters", "4", "--pseudo-to-real-switch-iter", "100",
                  "--log-json", str(pseudo_only), env_extra=ENV)
    a, b = json.loads(switched.read_text()), json.loads(pseudo_only.read_text())
    # The real model takes over at iteration 3 computing exactly what the pseudo model would have.
    assert [r["loss"] for r in a[:4]] == [r["loss"] for r in b[:4]]
    assert [r["params"] for r in a] == [b[0]["params"]] * 3 + [a[3]["params"]] * 3
    assert a[3]["params"] > 3 * b[0]["params"]
    assert all(r["routers"] == ["ExpertPrototypingRouter"] for r in a)
    assert a[5]["loss"] < a[0]["loss"]
