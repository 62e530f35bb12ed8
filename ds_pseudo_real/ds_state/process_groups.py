"""The process groups DeepSpeed reduces gradients over: the data-parallel group and each expert group's.
Only looks them up; makes no group and runs no collective (DeepSpeed 0.19.8)."""
from __future__ import annotations


def data_parallel_group():
    """The process group DeepSpeed averages dense gradients over: the mpu's data-parallel group when the engine was
    given one, else a copy of the world (DeepSpeed 0.19.8 ``groups._get_data_parallel_group``)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


def expert_data_parallel_group(name: str):
    """The process group DeepSpeed averages the gradients of expert group ``name`` over."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_group(name)
