"""Megatron-core patches for Pseudo-to-Real training and the M6 expert-prototyping MoE.

Modules: ``cpu_compat`` (run megatron.core without CUDA), ``shared_block`` (shared-parameter TransformerBlock),
``stage_copies`` (a shared set's copies on several pipeline stages kept one set), ``delink`` (pseudo -> real in process or from a dist checkpoint), ``moe`` (expert-prototyping router for
megatron.core's MoE layer), ``run`` (the drop-in ``python -m megatron_patches.run pretrain_gpt.py ...``).
Written against megatron-core 0.16.1.

Every change this package makes to someone else's code, all reversible:
"""
from megatron_patches.cpu_compat import PATCHES as CPU_PATCHES, TRAINING_PATCHES as CPU_TRAINING_PATCHES

#: Changes outside the CPU layer. Each is scoped: undone on exit of its context or its run.
PATCHES = [
    "megatron.core.models.gpt.gpt_model.TransformerBlock -> SharedParameterTransformerBlock "
    "(shared_block.shared_parameter_decoder, only while a pseudo model is being built)",
    "megatron.training.arguments.parse_args and megatron.training.initialize.parse_args wrapped: the flags chained "
    "onto extra_args_provider (run.install, undone by run.uninstall)",
    "megatron.training.pretrain and megatron.training.training.pretrain wrapped: model_provider wrapped "
    "(run.install, undone by run.uninstall)",
    "megatron.core.datasets.utils.compile_helpers -> no-op when megatron-core is the wheel (its helpers_cpp is "
    "built, it has no Makefile) (run.install, undone by run.uninstall)",
    "megatron.core DistributedOptimizer.load_parameter_state_from_dp_reshardable under torch.no_grad (0.16.x only: "
    "resuming fp32 weights failed on an in-place copy into views of Parameters) (run.install, undone by run.uninstall)",
    "megatron.core DistributedOptimizer.sharded_param_state_fully_reshardable reads each parameter's state at its "
    "offset in the buckets' unpadded parts laid end to end (0.16.x only: it read at the padded offset, saving other "
    "parameters' state after a padded bucket end) (run.install, undone by run.uninstall)",
    "megatron.core.dist_checkpointing TorchDistLoadShardedStrategy.load: a shard requested several times by one rank "
    "(a set's copies in several virtual stages) is read once and given to every request "
    "(stage_copies.load_each_shard_once; run.install, undone by run.uninstall)",
    "megatron.training.training.train_step wrapped to delink at --pseudo-to-real-switch-iter (run, during pretrain)",
    "megatron.training.training.checkpoint_and_decide_exit wrapped: with --pseudo-to-real-real-layout, at the switch "
    "it saves (the distributed optimizer's fully reshardable format) and stops as at --exit-interval; pretrain then "
    "runs again on the real layout after megatron.training.training.destroy_global_state (run, during pretrain)",
    "Megatron-LM's parsed arguments: the real layout's sizes from the switch on (run.StageLayout); "
    "dist_ckpt_optim_fully_reshardable in a pseudo stage whose sets have copies on several stages, with the "
    "distributed optimizer, until the delink (run.PseudoToRealRun)",
    "megatron.training.training.finalize_model_grads wrapped: then the gradients of a shared set's copies on "
    "several pipeline stages are summed (stage_copies.with_copies_reduced; run, during pretrain)",
    "built models only: TopKRouter instances re-classed as ExpertPrototypingRouter (moe.use_prototyping_routers); "
    "at the delink, train()'s optimizer object takes the new optimizer's class and state (run._become)",
] + [f"{p.target} (cpu_compat: {p.reason})" for p in [*CPU_PATCHES, *CPU_TRAINING_PATCHES]]
