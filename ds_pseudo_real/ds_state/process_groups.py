"""The process groups DeepSpeed reduces gradients and their norm over: the data-parallel group, each expert group's
and the model-parallel group. Only looks them up; makes no group and runs no collective (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import Any, Optional, Tuple


def data_parallel_group():
    """The process group DeepSpeed averages dense gradients over: the mpu's data-parallel group when the engine was
    given one, else a copy of the world (DeepSpeed 0.19.8 ``groups._get_data_parallel_group``)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


def expert_data_parallel_group(name: str):
    """The process group DeepSpeed averages the gradients of expert group ``name`` over."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_group(name)


def model_parallel(engine) -> Tuple[Optional[Any], int]:
    """The group DeepSpeed sums gradient norms over (the mpu's model-parallel group: tensor and pipeline ranks of one
    model replica; a PipelineEngine's grid is its mpu) and this rank's tensor-parallel rank; ``(None, 0)`` without an
    mpu. DeepSpeed counts a parameter in the norm on every rank when it is split over the tensor-parallel ranks
    (:func:`splits_over_tensor_parallel`), else on tensor-parallel rank 0 only (``stage_1_and_2.py``
    ``get_grad_norm_direct``, ``bf16_optimizer.py`` ``get_grads_for_norm``)."""
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    mpu = engine.mpu
    if mpu is None:
        return None, 0
    return mpu.get_model_parallel_group(), bwc_tensor_model_parallel_rank(mpu)


def splits_over_tensor_parallel(param) -> bool:
    """``param`` is this rank's slice of a tensor-parallel weight (Megatron's ``tensor_model_parallel`` or the
    older ``model_parallel`` attribute, as DeepSpeed reads them)."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    return is_model_parallel_parameter(param)
