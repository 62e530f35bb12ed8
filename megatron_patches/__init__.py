"""Megatron-core patches for Pseudo-to-Real training and the M6 expert-prototyping MoE.

Modules: ``cpu_compat`` (run megatron.core without CUDA), ``shared_block`` (shared-parameter TransformerBlock),
``delink`` (pseudo -> real in process or from a dist checkpoint), ``moe`` (expert-prototyping router for
megatron.core's MoE layer), ``run`` (the drop-in ``python -m megatron_patches.run pretrain_gpt.py ...``).
Written against megatron-core 0.16.1.

Every change this package makes to someone else's code, all reversible:
"""
from megatron_patches.cpu_compat import PATCHES as CPU_PATCHES

#: Patches outside the CPU layer, each applied only inside a context manager or by ``run`` and undone after.
PATCHES = [
    "megatron.core.models.gpt.gpt_model.TransformerBlock -> SharedParameterTransformerBlock "
    "(shared_block.shared_parameter_decoder, while the pseudo model is built)",
    "megatron.training: argument parser extended and train_step wrapped (run.py, for the drop-in flag)",
] + [f"{p.target} (cpu_compat: {p.reason})" for p in CPU_PATCHES]
