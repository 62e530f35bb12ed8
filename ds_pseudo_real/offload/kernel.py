"""DeepSpeed's CPU Adam kernel for the host step: through ``DeepSpeedCPUAdam``, or through the same kernel compiled
into an op of this package whose calls release Python's GIL (the overlapped host step's worker thread).

Owns: that op's build (DeepSpeed's own builder for its CPU Adam, with this package's binding in place of DeepSpeed's
and a name of its own: DeepSpeed's kernel source and compile flags, a separate build in ``TORCH_EXTENSIONS_DIR``)
and the kernel instances. Must not step anything itself. Written against DeepSpeed 0.19.8 (``csrc/adam/
cpu_adam_impl.cpp``: ``create_adam_optimizer``, ``ds_adam_step``). Both bindings call the same compiled kernel code
on the same arguments, so their results are equal bit for bit (``tests/offload/test_host_step.py`` compares them).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import torch

BINDING = Path(__file__).resolve().parent / "csrc" / "cpu_adam_without_gil.cpp"
OP_NAME = "ds_pseudo_real_cpu_adam"
_ids = itertools.count()


def gil_free_builder():
    """DeepSpeed's CPU Adam builder (the class ``DeepSpeedCPUAdam`` builds with) for this package's op."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class GilFreeCPUAdamBuilder(CPUAdamBuilder):
        BUILD_VAR = "DS_PSEUDO_REAL_BUILD_CPU_ADAM"
        NAME = OP_NAME

        def absolute_name(self):
            return f"ds_pseudo_real.offload.{OP_NAME}_op"  # never pre-installed: built on first use

        def sources(self):
            return [str(BINDING), "csrc/adam/cpu_adam_impl.cpp"]

    return GilFreeCPUAdamBuilder()


class GilFreeCPUAdam:
    """What the host step reads of a ``DeepSpeedCPUAdam`` (``ds_opt_adam``, ``opt_id``), over this package's op: a
    kernel instance created with the same hyperparameters."""

    def __init__(self, lr: float, betas, eps: float, weight_decay: float, adamw_mode: bool):
        self.ds_opt_adam = gil_free_builder().load(verbose=False)
        self.opt_id = next(_ids)
        self.ds_opt_adam.create_adam(self.opt_id, lr, betas[0], betas[1], eps, weight_decay, adamw_mode, False)

    def __del__(self):
        try:
            self.ds_opt_adam.destroy_adam(self.opt_id)
        except Exception:  # at interpreter exit the op may be gone first
            pass


def cpu_adam(lr: float, betas, eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool,
             without_gil: bool):
    """A kernel instance: this package's op when ``without_gil``, else a ``DeepSpeedCPUAdam`` (whose binding holds
    the GIL for a call)."""
    if without_gil:
        return GilFreeCPUAdam(lr, betas, eps, weight_decay, adamw_mode)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps,
                            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction)
