"""DeepSpeed's fp16 path on the CPU, for the tests: with ``DS_PSEUDO_REAL_TEST_CPU_FP16=1`` in its environment a
process's DeepSpeed CPU accelerator reports fp16 support (tests/conftest.py's ``cpu_fp16`` fixture sets it for a test
and the processes it starts, whose ``sitecustomize`` calls :func:`install`).

DeepSpeed 0.19.8's CPU accelerator refuses fp16 only because ``CPU_Accelerator.is_fp16_supported`` asks oneDNN for
native fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported``), which this CPU lacks; torch itself runs every
fp16 op the tests use on the CPU. With the answer True, DeepSpeed builds the same fp16 optimizers it builds on a GPU
(``FP16_UnfusedOptimizer`` at ZeRO 0 with a torch optimizer, ``DeepSpeedZeroOptimizer`` at ZeRO 1/2,
``DeepSpeedZeroOptimizer_Stage3``) with their dynamic loss scaler, overflow checks, unscaling and fp32 masters: all
Python code, the same as on a GPU. What this skips: the GPU's fp16 kernels and tensor cores (their rounding and
speed), and DeepSpeed's CUDA-only fp16 code (FusedAdam's CUDA kernel, the fused FP16_Optimizer's multi-tensor ops);
torch's CPU fp16 kernels compute in their own way, so losses are compared between runs here, never with a GPU's."""
import importlib.abc
import importlib.util
import os
import sys

ENV = "DS_PSEUDO_REAL_TEST_CPU_FP16"
MODULE = "deepspeed.accelerator.cpu_accelerator"


def report_fp16(module) -> None:
    """Make ``module``'s CPU accelerator report fp16 support (its ``supported_dtypes`` follow)."""
    module.CPU_Accelerator.is_fp16_supported = lambda self: True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when DeepSpeed's CPU accelerator module is imported, it reports fp16 once it has run."""

    def find_spec(self, name, import_path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # patched once; the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            report_fp16(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """In this process, where ``DS_PSEUDO_REAL_TEST_CPU_FP16`` is 1: now if the module is imported, else on its
    import."""
    if os.environ.get(ENV) != "1":
        return
    module = sys.modules.get(MODULE)
    if module is not None:
        report_fp16(module)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
