"""Pseudo-to-Real through Megatron-LM's ``pretrain_gpt.py`` on model-parallel layouts: pipeline parallelism (sharing
groups inside a stage, or split between stages), virtual pipeline stages, tensor parallelism with and without
sequence parallelism, and the M6 MoE with expert x tensor parallelism; torch_dist checkpoints under them; and a
layout per stage (``--pseudo-to-real-real-layout``: the pseudo stage data parallel, the real one tensor or
pipeline parallel, switched in process).

Every layout resumes from the same checkpoint, written at iteration 1 by a run on the reference layout (one rank,
or expert parallelism alone for the MoE); Megatron's dist checkpointing reshards it (weights, and the distributed
optimizer's state in its fully reshardable format). Different layouts cannot be compared from scratch: Megatron
seeds each pipeline stage's and tensor-parallel rank's initialisation differently. The switch is at iteration 4 of
7, so iteration 4 is the pseudo model's after two steps on the layout, 5 the real model's first, 6-7 after it.

Tolerance: fp32, same batches; a layout changes only the order of the sums (a shared set's gradient summed over
stages instead of layer after layer, tensor-parallel all-reduces), which moves the losses by a few float32 ulps
(~1e-7 relative): below the 7 digits Megatron prints. Losses must agree to 2e-6 (two units of the last printed
digit at a loss of about 5), the printed gradient norms to their 3 decimals.
"""
import argparse
import re

import pytest
from megatron_lm import M6, Sequence, check_resumed_run, needs_megatron_lm, resume_from, same_losses

from ds_pseudo_real.sharing import groups_in_range
from megatron_patches.run import format_layout, parse_layout
from megatron_patches.stage_copies import Holding, copy_group_ranks

pytestmark = pytest.mark.no_ops  # Megatron's own optimizers: never waits for DeepSpeed's C++ ops

SWITCH, ITERS = 4, 7
COMPARED = [4, 5, 6, 7]
TOLERANCE = 2e-6
# The distributed optimizer, saved in the format dist checkpointing reshards across tensor and pipeline parallelism.
COMMON = ["--train-iters", str(ITERS), "--pseudo-to-real-switch-iter", str(SWITCH), "--use-distributed-optimizer",
          "--dist-ckpt-optim-fully-reshardable", "--save-interval", "1"]
SWITCHING = [flag for flag in COMMON if flag != "--dist-ckpt-optim-fully-reshardable"]
G1 = ["--pseudo-to-real-groups", "1", "--pseudo-to-real-optimizer-state", "scale"]
G2 = ["--pseudo-to-real-groups", "2"]
PP2, TP2 = ["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]
MOE = [*M6, "--disable-bias-linear", *G2]
# 4 layers, hidden 64, ffn 256: one layer's parameters.
LAYER = 49_984


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The references, every layout resumed from them, and relaunches of the layouts' own checkpoints at the
    switch (pseudo model) and after it (real model): two launches (one rank, two ranks), each running its
    configurations one after the other (``Sequence``)."""
    tmp = tmp_path_factory.mktemp("layouts")
    one, two, directories = Sequence(1, tmp), Sequence(2, tmp), {}

    def reference(sequence, name, *flags):
        sequence.train(name, *COMMON, *flags, "--save", str(tmp / name))
        directories[name] = tmp / name

    def layout(name, ref, *flags):
        directories[name] = two.resume_from(name, directories[ref], 1, *COMMON, *flags)

    reference(one, "ref_g1", *G1)
    reference(one, "ref_g2", *G2)
    reference(two, "ref_moe", *MOE)
    layout("pp2_g1", "ref_g1", *G1, *PP2)
    layout("pp2_g2", "ref_g2", *G2, *PP2)
    layout("vpp2_g1", "ref_g1", *G1, *PP2, "--num-layers-per-virtual-pipeline-stage", "1")
    layout("tp2_g1", "ref_g1", *G1, *TP2)
    layout("tp2_sp_g2", "ref_g2", *G2, *TP2, "--sequence-parallel")
    layout("tp2_sp_ep2_moe", "ref_moe", *MOE, *TP2, "--sequence-parallel", "--expert-tensor-parallel-size", "1")
    for name, flags, iteration in [("pp2_g1", [*G1, *PP2], SWITCH), ("tp2_g1", [*G1, *TP2], SWITCH + 1)]:
        two.resume_from(f"{name}_from_{iteration}", directories[name], iteration, *COMMON, *flags)
    # A layout per stage: data parallel (2 ranks) in the pseudo stage, then TP=2 or PP=2; the distributed optimizer
    # in its default checkpoint format (only data-parallel reshardable).
    for real in ("tp=2", "pp=2"):
        name = f"dp2_to_{real[:2]}2"
        directories[name] = tmp / name
        two.train(name, *SWITCHING, *G1, "--pseudo-to-real-real-layout", real, "--save", str(directories[name]),
                  "--load", str(directories[name]))
    # The same command relaunched after a kill in the real stage: it takes the real layout by itself.
    two.resume_from("dp2_to_tp2_relaunched", directories["dp2_to_tp2"], SWITCH + 1, *SWITCHING, *G1,
                    "--pseudo-to-real-real-layout", "tp=2")
    return {**one.logs(), **two.logs(), **{name + "_dir": directory for name, directory in directories.items()}}


@needs_megatron_lm
@pytest.mark.parametrize("name, ref", [("pp2_g1", "ref_g1"), ("pp2_g2", "ref_g2"), ("vpp2_g1", "ref_g1"),
                                       ("tp2_g1", "ref_g1"), ("tp2_sp_g2", "ref_g2"),
                                       ("tp2_sp_ep2_moe", "ref_moe")])
def test_loss_of_a_layout_is_the_reference_layouts(runs, name, ref):
    """In the pseudo stage, at the delink and after it: the losses and gradient norms of the reference layout.
    Equal gradient norms also say that a set held on two stages is counted once (its second copy is ``shared``).
    With one group: the set's copies on both stages (PP=2), and on both virtual stages of each rank too (VPP,
    whose checkpoint load asks for the set once per rank); ``scale`` divides the moments by the 4 layers that
    shared them, not by a stage's 2."""
    assert runs[name].iterations == list(range(2, ITERS + 1))
    same_losses(runs[ref], runs[name], COMPARED, TOLERANCE)


@needs_megatron_lm
def test_pipeline_stages_hold_their_copies_of_the_shared_sets(runs):
    """Per (tensor, pipeline) rank, the parameters of the pseudo model, then of the real one. PP=2 with one group:
    each stage holds a copy of the set (its 2 layers share it); with 2 groups, each stage holds one group. The
    delink gives each stage its other layer's parameters."""
    for name in ("pp2_g1", "pp2_g2"):
        counts = runs[name].stage_params
        assert sorted(counts) == [(0, 0), (0, 1)]
        assert all(pseudo == real - LAYER for pseudo, real in counts.values()), counts
    assert runs["pp2_g1"].stage_params == runs["pp2_g2"].stage_params
    # Virtual stages of one layer each: every chunk holds a copy of the set, as many parameters as the real model.
    assert all(pseudo == real for pseudo, real in runs["vpp2_g1"].stage_params.values())


@needs_megatron_lm
@pytest.mark.parametrize("name, iteration", [("pp2_g1", SWITCH), ("tp2_g1", SWITCH + 1)])
def test_torch_dist_checkpoints_of_a_layout_resume(runs, name, iteration):
    """Killed after the checkpoint of the switch (the pseudo model: relaunched, it delinks at once; PP=2) or of the
    first real iteration (TP=2), relaunched on the same layout: every loss is the uninterrupted run's, exactly.
    (Each layout above also resumed the reference's pseudo checkpoint of iteration 1, resharded.)"""
    resumed = runs[f"{name}_from_{iteration}"]
    check_resumed_run(runs[name], resumed, iteration + 1, ITERS)
    assert resumed.grad_norms == {i: runs[name].grad_norms[i] for i in resumed.grad_norms}
    assert len(resumed.params) == (2 if iteration == SWITCH else 1)


@needs_megatron_lm
@pytest.mark.parametrize("name, real", [("dp2_to_tp2", (1, 2, 1)), ("dp2_to_pp2", (1, 1, 2))])
def test_a_layout_per_stage(runs, name, real):
    """The pseudo stage on 2 data-parallel ranks, the real one on TP=2 or PP=2, one command and one process per
    rank: at the switch the pseudo model is saved in a format dist checkpointing reshards (the distributed
    optimizer's fully reshardable one, which this command does not ask for), Megatron-LM's state is torn down and
    built again on the real layout, which loads it and delinks. Every loss and gradient norm, before and after the
    switch, is the reference's (one rank: the same computation up to summation order), so weights and Adam's
    moments (scaled for the 4 layers) came through the switch."""
    from megatron.core.dist_checkpointing import load_content_metadata

    run = runs[name]
    assert run.layouts == [(2, 1, 1), real]
    assert run.notes == [f"[megatron_patches] iteration {SWITCH}: pseudo model saved in {runs[name + '_dir']}; "
                         f"going on with the real layout {name[-3:-1]}=2"]
    assert run.iterations == list(range(1, ITERS + 1))
    # Iterations 2 and 6 are the second ones each pass of the script logged (see megatron_lm).
    same_losses(runs["ref_g1"], run, [1, 3, 4, 5, 7], TOLERANCE)
    assert run.grad_norms == pytest.approx(runs["ref_g1"].grad_norms, abs=1e-3, rel=0)
    sharding = {i: load_content_metadata(str(runs[name + "_dir"] / f"iter_{i:07d}"))["distrib_optim_sharding_type"]
                for i in (SWITCH - 1, SWITCH)}
    assert sharding == {SWITCH - 1: "dp_reshardable", SWITCH: "fully_reshardable"}


@needs_megatron_lm
def test_a_relaunch_after_the_switch_takes_the_real_layout(runs):
    """The same command, relaunched on the checkpoint of iteration 5 (after the switch): built on TP=2 from the
    start, it trains on as the uninterrupted run did (its gradient norms exactly; its one comparable loss, 6, is
    the reference's: the uninterrupted run logged 6 as the second line of its second pass)."""
    relaunched = runs["dp2_to_tp2_relaunched"]
    assert relaunched.layouts == [(1, 2, 1)] and relaunched.notes == []
    assert relaunched.iterations == [SWITCH + 2, ITERS]
    assert relaunched.grad_norms == {i: runs["dp2_to_tp2"].grad_norms[i] for i in relaunched.iterations}
    same_losses(runs["ref_g1"], relaunched, [SWITCH + 2], TOLERANCE)


@pytest.fixture(scope="module")
def four_ranks(runs, tmp_path_factory):
    """PP=2 x DP=2 in the pseudo stage (the set's copies on both stages, sharded by the distributed optimizer over 2
    data-parallel ranks), switched to TP=2 x PP=2 for the real stage: 4 ranks, one launch."""
    tmp = tmp_path_factory.mktemp("four_ranks")
    log, directory = resume_from(runs["ref_g1_dir"], 1, 4, *SWITCHING, *G1, *PP2, "--pseudo-to-real-real-layout",
                                 "tp=2,pp=2", cwd=tmp, name="pp2_dp2_to_tp2_pp2")
    return log, directory


@needs_megatron_lm
def test_pipeline_and_data_parallel_then_tensor_and_pipeline_parallel(runs, four_ranks):
    """The copies' gradients are summed after the distributed optimizer's reduce-scatter: each of their parameters
    has a bucket of its own, so both stages shard it alike (a wrong sum would move the losses and grad norms). The
    pseudo stage saves the fully reshardable format by itself here (the default refuses buckets a data-parallel
    rank holds nothing of). Same losses and grad norms as the one-rank reference, before and after the switch."""
    from megatron.core.dist_checkpointing import load_content_metadata

    run, directory = four_ranks
    assert run.layouts == [(2, 1, 2), (1, 2, 2)]
    assert run.iterations == list(range(2, ITERS + 1))
    same_losses(runs["ref_g1"], run, [4, 5, 7], TOLERANCE)  # 3 and 6: the second line of each pass
    assert run.grad_norms == pytest.approx({i: runs["ref_g1"].grad_norms[i] for i in run.iterations}, abs=1e-3)
    assert load_content_metadata(str(directory / f"iter_{SWITCH - 1:07d}"))["distrib_optim_sharding_type"] == \
        "fully_reshardable"
    assert load_content_metadata(str(directory / f"iter_{SWITCH + 1:07d}"))["distrib_optim_sharding_type"] == \
        "dp_reshardable"


def test_layout_flag_values():
    """--pseudo-to-real-real-layout: KEY=N items; the errors name the item and what is accepted."""
    assert parse_layout("tp=2,pp=2") == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    assert parse_layout("ep=4, sp=1,vpp=2") == {"expert_model_parallel_size": 4, "sequence_parallel": True,
                                                "num_layers_per_virtual_pipeline_stage": 2}
    assert format_layout(parse_layout("pp=2,tp=2,sp=0")) == "tp=2,pp=2,sp=0"
    for bad, message in [("tp2", "'tp2' in 'tp2': expected KEY=N items"), ("dp=2", "keys tp, pp, vpp, ep, etp, sp"),
                         ("tp=2,tp=4", "each key once"), ("tp=0", "tp=0 in 'tp=0': expected a size of at least 1"),
                         ("sp=2", "sp=2 in 'sp=2': expected sp=0 or sp=1")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse_layout(bad)


def test_groups_in_a_pipeline_stage():
    """A stage's layers (global indices) -> the groups with layers there, with their positions in the stage."""
    assert groups_in_range(range(0, 2), 4, 1) == [(0, [0, 1])]
    assert groups_in_range(range(2, 4), 4, 1) == [(0, [0, 1])]
    assert groups_in_range(range(2, 4), 4, 2) == [(1, [0, 1])]
    assert groups_in_range(range(3, 6), 6, 3) == [(1, [0]), (2, [1, 2])]


def test_process_groups_over_the_copies():
    """Each rank reports its pipeline group and the sets it holds copies of; a set's copies in one pipeline group
    get a process group over the ranks holding them (not the whole pipeline), one per pipeline group."""
    # PP=4 x DP=2 (pipelines (0, 2, 4, 6) and (1, 3, 5, 7)), 4 layers in 2 groups: stages 0-1 hold group 0,
    # stages 2-3 group 1.
    holdings = [Holding(rank, pipeline, frozenset({stage // 2}))
                for pipeline in [(0, 2, 4, 6), (1, 3, 5, 7)] for stage, rank in enumerate(pipeline)]
    assert copy_group_ranks(holdings) == [(0, (0, 2)), (0, (1, 3)), (1, (4, 6)), (1, (5, 7))]
    # A set on one rank only (its copies in several virtual stages there) needs no process group.
    assert copy_group_ranks([Holding(0, (0, 1), frozenset({0, 1})), Holding(1, (0, 1), frozenset({1}))]) == \
        [(1, (0, 1))]
