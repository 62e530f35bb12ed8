"""Pseudo-to-Real through Megatron-LM's ``pretrain_gpt.py`` on model-parallel layouts: pipeline parallelism (sharing
groups inside a stage, or split between stages), virtual pipeline stages, tensor parallelism with and without
sequence parallelism, and the M6 MoE with expert x tensor parallelism; torch_dist checkpoints under them.

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
import pytest
from megatron_lm import M6, check_resumed_run, copy_checkpoint, needs_megatron_lm, resume_from, same_losses, train

from megatron_patches.stage_copies import Holding, copy_group_ranks
from ds_pseudo_real.sharing import groups_in_range

SWITCH, ITERS = 4, 7
COMPARED = [4, 5, 6, 7]
TOLERANCE = 2e-6
# The distributed optimizer, saved in the format dist checkpointing reshards across tensor and pipeline parallelism.
COMMON = ["--train-iters", str(ITERS), "--pseudo-to-real-switch-iter", str(SWITCH), "--use-distributed-optimizer",
          "--dist-ckpt-optim-fully-reshardable", "--save-interval", "1"]
G1 = ["--pseudo-to-real-groups", "1", "--pseudo-to-real-optimizer-state", "scale"]
G2 = ["--pseudo-to-real-groups", "2"]
PP2, TP2 = ["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]
MOE = [*M6, "--disable-bias-linear", *G2]
# 4 layers, hidden 64, ffn 256: one layer's parameters.
LAYER = 49_984


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per configuration: the references, every layout resumed from them, and relaunches of the
    layouts' own checkpoints at the switch (pseudo model) and after it (real model)."""
    tmp = tmp_path_factory.mktemp("layouts")
    r = {}

    def reference(name, nproc, *flags):
        r[name] = train(nproc, *COMMON, *flags, "--save", str(tmp / name), cwd=tmp)

    def layout(name, ref, nproc, *flags):
        r[name], r[name + "_dir"] = resume_from(tmp / ref, 1, nproc, *COMMON, *flags, cwd=tmp, name=name)

    reference("ref_g1", 1, *G1)
    reference("ref_g2", 1, *G2)
    reference("ref_moe", 2, *MOE)
    layout("pp2_g1", "ref_g1", 2, *G1, *PP2)
    layout("pp2_g2", "ref_g2", 2, *G2, *PP2)
    layout("vpp2_g1", "ref_g1", 2, *G1, *PP2, "--num-layers-per-virtual-pipeline-stage", "1")
    layout("tp2_g1", "ref_g1", 2, *G1, *TP2)
    layout("tp2_sp_g2", "ref_g2", 2, *G2, *TP2, "--sequence-parallel")
    layout("tp2_sp_ep2_moe", "ref_moe", 2, *MOE, *TP2, "--sequence-parallel", "--expert-tensor-parallel-size", "1")
    for name, flags, iteration in [("pp2_g1", [*G1, *PP2], SWITCH), ("tp2_g1", [*G1, *TP2], SWITCH + 1)]:
        directory = copy_checkpoint(r[name + "_dir"], iteration, tmp / f"{name}_killed_after_{iteration}")
        r[f"{name}_from_{iteration}"] = train(2, *COMMON, *flags, "--load", str(directory), "--save",
                                              str(directory), cwd=tmp)
    return r


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
