"""The drop-in on Megatron-LM's own ``pretrain_gpt.py``: ``torchrun -m megatron_patches.run pretrain_gpt.py ...``,
fp32, bf16 and fp16 (Megatron's dynamic grad scaler), 1 and 2 ranks (data and expert parallel); how a run is
launched and read: ``megatron_lm``.
"""
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import REPO, free_port, python_path
from megatron_lm import M6, MEGATRON_LM, TINY, Sequence, check_resumed_run, needs_megatron_lm, pretrain

from megatron_patches.run import (RELEASE, TRACKER_FILE, check_arguments, checkpoint_to_load,
                                  pseudo_stage_at_start)

pytestmark = pytest.mark.no_ops  # Megatron's own optimizers: never waits for DeepSpeed's C++ ops

SWITCH = 3
# 4 layers, hidden 64, ffn 256: 49,984 parameters per layer; the delink adds 3 layers' worth.
PSEUDO_PARAMS, REAL_PARAMS = 68_544, 68_544 + 3 * 49_984


def checkpoint_and_resume_across_the_switch(nproc: int, extra: list, tmp: Path, resume_twice: bool) -> Sequence:
    """The uninterrupted run (switch at 3 of 8, a torch_dist checkpoint every iteration), the same run never
    delinking, and a relaunch from the pseudo model saved at the switch (it delinks on resuming); with
    ``resume_twice``, another from the real model that relaunch saved after the switch. In one launch."""
    common = [*extra, "--train-iters", "8", "--pseudo-to-real-switch-iter", str(SWITCH)]
    runs = Sequence(nproc, tmp)
    runs.train("full", *common, "--save", str(tmp / "full"), "--save-interval", "1")
    runs.train("never", *extra, "--train-iters", "8", "--exit-interval", "4", "--pseudo-to-real-switch-iter", "100")
    saved = runs.resume_from("at_switch", tmp / "full", SWITCH, *common, "--save-interval", "2")
    if resume_twice:
        runs.resume_from("after_switch", saved, SWITCH + 1, *common, "--save-interval", "100")
    return runs


def with_async_saves(runs: Sequence, extra: list, tmp: Path) -> dict:
    """``runs`` and, in the same launch (last: Megatron's persistent checkpoint worker stays until the process
    ends), the uninterrupted run with ``--async-save``, then its relaunch from the switch."""
    common = [*extra, "--train-iters", "8", "--pseudo-to-real-switch-iter", str(SWITCH), "--async-save",
              "--use-persistent-ckpt-worker"]
    runs.train("async", *common, "--save", str(tmp / "async"), "--save-interval", "1")
    runs.resume_from("async_at_switch", tmp / "async", SWITCH, *common, "--save-interval", "100")
    return {**runs.logs(), "checkpoints": tmp / "full", "async_checkpoints": tmp / "async"}


FP16 = ["--fp16", "--no-masked-softmax-fusion", "--initial-loss-scale", "1024", "--loss-scale-window", "2",
        "--use-distributed-optimizer", "--train-iters", "6"]


def fp16_runs(runs: Sequence, tmp: Path) -> None:
    """Add to ``runs``: --fp16 with Megatron's dynamic grad scaler (from 2**10, doubled after 2 iterations without
    overflow; the fused softmax is CUDA only) and its distributed optimizer, the run through the switch saving every
    iteration, the same run never delinking, and relaunches from the pseudo model saved at the switch and from the
    real model after it."""
    switch = ["--pseudo-to-real-switch-iter", str(SWITCH)]
    runs.train("fp16_full", *FP16, *switch, "--save", str(tmp / "fp16_full"), "--save-interval", "1")
    runs.train("fp16_never", *FP16, "--pseudo-to-real-switch-iter", "100", "--exit-interval", "4")
    for name, iteration in (("fp16_at_switch", SWITCH), ("fp16_after_switch", SWITCH + 1)):
        runs.resume_from(name, tmp / "fp16_full", iteration, *FP16, *switch, "--save-interval", "100")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    runs = checkpoint_and_resume_across_the_switch(1, [], tmp, resume_twice=False)
    fp16_runs(runs, tmp)
    return with_async_saves(runs, [], tmp)


@needs_megatron_lm
def test_fp16_the_delink_carries_the_grad_scaler_and_resumes_exactly(one_rank):
    """--fp16 through Megatron-LM's pretrain_gpt.py with its distributed optimizer: the delink at iteration 3 keeps
    the loss (the real model's fp16 weights are the shared set's) and Megatron's grad scaler: the scale goes on growing across the switch as in the
    run that never delinks (a fresh scaler would start again from 2**10). Relaunched from the pseudo checkpoint at
    the switch (it delinks on resuming) and from the real one after it, the runs print the uninterrupted losses and
    loss scales."""
    full, never = one_rank["fp16_full"], one_rank["fp16_never"]
    assert [full.losses[i] for i in (1, 3, 4)] == [never.losses[i] for i in (1, 3, 4)]
    assert full.params == [PSEUDO_PARAMS, REAL_PARAMS]
    assert full.loss_scales == {1: 2**10, 2: 2**11, 3: 2**11, 4: 2**12, 5: 2**12, 6: 2**13}
    assert {i: full.loss_scales[i] for i in never.loss_scales} == never.loss_scales
    for name, first in (("fp16_at_switch", SWITCH + 1), ("fp16_after_switch", SWITCH + 2)):
        check_resumed_run(full, one_rank[name], first, 6)
        assert one_rank[name].loss_scales == {i: full.loss_scales[i] for i in range(first, 7)}, name


def m6_moe_runs(runs: Sequence, tmp: Path) -> None:
    """Add to a two-rank ``runs``: M6 expert prototyping (4 experts in 2 prototypes) with EP=2, 2 sharing groups,
    --bf16 (the fused softmax is CUDA only) and the distributed optimizer with overlapped grad reduce: the run through
    the switch saving at it, the same run never delinking, and a relaunch from the pseudo checkpoint at the switch."""
    common = [*M6, "--disable-bias-linear", "--bf16", "--no-masked-softmax-fusion", "--use-distributed-optimizer",
              "--overlap-grad-reduce", "--train-iters", "6", "--pseudo-to-real-groups", "2"]
    runs.train("m6_full", *common, "--pseudo-to-real-switch-iter", str(SWITCH), "--save", str(tmp / "m6_full"),
               "--save-interval", str(SWITCH))
    runs.train("m6_never", *common, "--pseudo-to-real-switch-iter", "100", "--exit-interval", "4")
    runs.resume_from("m6_resumed", tmp / "m6_full", SWITCH, *common, "--pseudo-to-real-switch-iter", str(SWITCH),
                     "--save-interval", "100")


@pytest.fixture(scope="module")
def two_ranks_distributed_optimizer(tmp_path_factory):
    """The two-rank runs of this module in one launch: the switch and its resumes, the M6 MoE's runs, the async
    saves last."""
    tmp, extra = tmp_path_factory.mktemp("two_ranks"), ["--use-distributed-optimizer"]
    runs = checkpoint_and_resume_across_the_switch(2, extra, tmp, resume_twice=True)
    m6_moe_runs(runs, tmp)
    return with_async_saves(runs, extra, tmp)


@needs_megatron_lm
@pytest.mark.parametrize("runs", ["one_rank", "two_ranks_distributed_optimizer"])
def test_loss_continuous_at_the_delink(runs, request):
    """The real model's first loss (iteration 4, computed after the delink at 3) is the loss of the run that never
    delinks, to the printed 7 digits; the parameters grow from one layer's set to four."""
    r = request.getfixturevalue(runs)
    full, never = r["full"], r["never"]
    assert [full.losses[i] for i in (1, 3, 4)] == [never.losses[i] for i in (1, 3, 4)]
    assert full.params == [PSEUDO_PARAMS, REAL_PARAMS] and never.params == [PSEUDO_PARAMS]
    assert full.losses[8] < full.losses[1]
    # The run that never delinks says so at start, once (rank 0).
    assert full.warnings == [] and never.warnings == [
        "[megatron_patches] WARNING: --pseudo-to-real-switch-iter 100 is beyond --train-iters 8: this run trains only "
        "the pseudo model"]
    # The delink says what it did, as on the DeepSpeed side, once (rank 0).
    assert len(full.delinks) == 1 and never.delinks == []
    assert re.fullmatch(rf"\[ds_pseudo_real\] delinked at iteration {SWITCH} in \d+\.\d\ds: parameters per rank "
                        rf"{PSEUDO_PARAMS:,} -> {REAL_PARAMS:,}, in total {PSEUDO_PARAMS:,} -> {REAL_PARAMS:,}; "
                        rf"optimizer state 'copy'; parameter groups 1 -> 4", full.delinks[0]), full.delinks


@needs_megatron_lm
@pytest.mark.parametrize("runs", ["one_rank", "two_ranks_distributed_optimizer"])
def test_torch_dist_checkpoints_resume_across_the_switch(runs, request):
    """torch_dist (Megatron's default format) saved in the pseudo stage at the switch, resumed: the pseudo model is
    rebuilt from a checkpoint holding its shared set once, delinks, and saves the real model; with the distributed
    optimizer that is resumed in turn. Every relaunch prints the uninterrupted run's losses (fp32, same batches):
    model, Adam's moments, its step and the LR schedule all came back."""
    r = request.getfixturevalue(runs)
    check_resumed_run(r["full"], r["at_switch"], SWITCH + 1, 8)
    assert r["at_switch"].params == [PSEUDO_PARAMS, REAL_PARAMS]
    if "after_switch" in r:
        check_resumed_run(r["full"], r["after_switch"], SWITCH + 2, 8)
        assert r["after_switch"].params == [REAL_PARAMS]


@needs_megatron_lm
@pytest.mark.parametrize("runs", ["one_rank", "two_ranks_distributed_optimizer"])
def test_async_save_in_the_pseudo_stage_and_across_the_switch_resumes_exactly(runs, request):
    """Megatron's ``--async-save`` (torch_dist, its persistent checkpoint worker), on one rank and on 2 with the
    distributed optimizer: every iteration's checkpoint is written in the background while the pseudo model
    trains, delinks at 3 and trains on, with the synchronous run's losses; relaunched from the pseudo model saved
    asynchronously at the switch, the run delinks and prints the uninterrupted losses (fp32)."""
    r = request.getfixturevalue(runs)
    assert r["async"].losses == r["full"].losses and r["async"].params == [PSEUDO_PARAMS, REAL_PARAMS]
    assert sorted(p.name for p in r["async_checkpoints"].glob("iter_*")) == [f"iter_{i:07d}" for i in range(1, 9)]
    check_resumed_run(r["full"], r["async_at_switch"], SWITCH + 1, 8)
    assert r["async_at_switch"].params == [PSEUDO_PARAMS, REAL_PARAMS]


@needs_megatron_lm
def test_pseudo_checkpoint_holds_the_shared_set_once(one_rank):
    """The pseudo model's checkpoint stacks one layer (its 4 layers' shared set), weights and Adam's moments alike;
    the real model's, four."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    keys = [qkv, f"optimizer.state.exp_avg.{qkv}", f"optimizer.state.exp_avg_sq.{qkv}"]
    for iteration, layers in [(SWITCH, 1), (SWITCH + 1, 4)]:
        metadata = load_tensors_metadata(str(one_rank["checkpoints"] / f"iter_{iteration:07d}"))
        assert [tuple(metadata[k].global_shape) for k in keys] == [(layers, 192, 64)] * 3


@needs_megatron_lm
def test_m6_moe_expert_parallel_2_bf16_two_groups(two_ranks_distributed_optimizer):
    """M6 expert prototyping with EP=2 on 2 ranks (``m6_moe_runs``): the delink keeps the loss bit for bit (the real
    model's bf16 weights are the pseudo model's), and a torch_dist checkpoint of the pseudo model at the switch
    resumes into the same losses."""
    full, never, resumed = (two_ranks_distributed_optimizer[name] for name in ("m6_full", "m6_never", "m6_resumed"))
    assert [full.losses[i] for i in (1, 3, 4)] == [never.losses[i] for i in (1, 3, 4)]
    # Rank 0's parameters (2 of the 4 experts of every layer): two layers' sets, then four.
    assert full.params == [183_424, 348_288] and never.params == [183_424]
    check_resumed_run(full, resumed, SWITCH + 1, 6)


def test_m6_refuses_biases_naming_the_flag():
    """Checked at the first model build (test_flag_errors_read_like_megatrons sees that check from the script)."""
    args = Namespace(pseudo_to_real_switch_iter=3, pseudo_to_real_groups=1, num_layers=4, m6_expert_prototypes=2,
                     num_experts=4, moe_router_topk=2, moe_router_load_balancing_type="none", add_bias_linear=True,
                     pseudo_to_real_real_layout=None)
    with pytest.raises(AssertionError, match=re.escape(
            "--m6-expert-prototypes needs --disable-bias-linear (M6's experts carry no bias); got Megatron's "
            "default, biases on")):
        check_arguments(args)
    args.add_bias_linear = False
    check_arguments(args)


@needs_megatron_lm
def test_help_lists_the_flags_with_defaults(tmp_path):
    proc = pretrain(1, "--help", cwd=tmp_path)
    help_text = " ".join(proc.stdout.split())
    assert "--num-layers" in help_text  # Megatron's own flags are still there
    group = help_text.split("pseudo-to-real and M6 (megatron_patches):", 1)[1]
    for flag, default in [("--pseudo-to-real-switch-iter", "Default: None"), ("--pseudo-to-real-groups", "Default: 1"),
                          ("--pseudo-to-real-optimizer-state {copy,reset,scale}", "Default: copy"),
                          ("--pseudo-to-real-real-layout KEY=N,...", "Default: None (one layout)"),
                          ("--m6-expert-prototypes", "Default: None")]:
        assert default in group.split(flag, 1)[1][:400], flag


def rank_errors(proc: subprocess.CompletedProcess) -> list:
    """The ``error:`` lines the ranks printed, and whether torchrun's failure summary has a rank exiting 2 (the first
    rank to exit makes torchrun stop the others with SIGTERM)."""
    exits = re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")], "2" in exits


@needs_megatron_lm
def test_flag_errors_are_one_error_line_from_rank_0(tmp_path):
    bad_choice = pretrain(1, *TINY, "--train-iters", "1", "--pseudo-to-real-optimizer-state", "keep", cwd=tmp_path,
                          expect_ok=False)
    assert bad_choice.returncode != 0
    assert "argument --pseudo-to-real-optimizer-state: invalid choice: 'keep'" in bad_choice.stderr  # argparse's
    bad_groups = pretrain(2, *TINY, "--train-iters", "1", "--pseudo-to-real-switch-iter", "2",
                          "--pseudo-to-real-groups", "3", cwd=tmp_path, expect_ok=False)
    assert bad_groups.returncode != 0
    errors, exit_2 = rank_errors(bad_groups)
    assert errors == ["error: --pseudo-to-real-groups (3) must be >= 1 and divide --num-layers (4)"], bad_groups.stderr
    assert exit_2 and "AssertionError" not in bad_groups.stderr, bad_groups.stderr[-3000:]


@needs_megatron_lm
def test_a_save_folder_in_use_by_another_run_is_refused(tmp_path):
    """The drop-in holds --save's lock as the main job holds its output folder's: another run holding it stops this
    one before it trains or writes, with one error naming the holder."""
    env = dict(os.environ, PYTHONPATH=python_path())
    (tmp_path / "ckpt").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from ds_pseudo_real.checkpointing import lock; "
                               "lock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
                               str(tmp_path / "ckpt")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline() == "held\n"
        proc = pretrain(1, *TINY, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                        cwd=tmp_path, expect_ok=False)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    errors, exit_2 = rank_errors(proc)
    assert len(errors) == 1 and exit_2, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {tmp_path / 'ckpt'} is in use by another run (host ") and \
        f"pid {holder.pid}," in errors[0]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["run.lock"]  # nothing saved


def test_usage_error_without_a_script():
    usage = subprocess.run([sys.executable, "-m", "megatron_patches.run", "no_such_script.py"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "SCRIPT 'no_such_script.py' is not a file" in usage.stderr


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


@needs_megatron_lm
def test_the_process_group_the_script_opened_is_destroyed_before_main_returns(tmp_path):
    """Megatron-LM's scripts leave their process group to the interpreter's teardown, where gloo's worker threads can
    free tensors after Python has gone and abort a rank (SIGABRT) whose run passed; ``main`` destroys it."""
    script = tmp_path / "opens_a_group.py"
    script.write_text("import torch.distributed as dist\n"
                      "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, world_size=1)\n"
                      "dist.all_reduce(__import__('torch').ones(1))\n" % free_port())
    driver = ("import sys; import torch.distributed as dist; from megatron_patches.run import main; "
              "rc = main(sys.argv[1:]); print('process group alive after main:', dist.is_initialized()); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", driver, str(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=python_path(MEGATRON_LM)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "process group alive after main: False" in proc.stdout
