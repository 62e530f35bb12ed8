"""ZeRO-3's flat fp32 sub-groups: a parameter's partition in them, and the sub-groups swapped to NVMe, in memory
while used. Writes only what its caller hands it; checkpoint files are nvme_checkpoint.py's (DeepSpeed 0.19.8)."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .layout import basic_optimizer


def swapped_sub_groups(engine) -> List[int]:
    """The sub-groups a ZeRO-3 optimizer swaps to NVMe (``offload_optimizer: nvme``): their fp32 master and moments
    live in files and are in memory only while DeepSpeed steps them (smaller ones, under 1 MiB, stay in memory)."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "swap_optimizer", False):
        return []
    return [i for i in range(len(optimizer.fp32_partitioned_groups_flat)) if optimizer._swappable_optimizer_subgroup(i)]


def swapped_sub_group_of(engine, param: torch.nn.Parameter, swapped) -> Optional[int]:
    """The sub-group among ``swapped`` holding ``param``'s fp32 state, None when it is held in memory."""
    if not (swapped and param.requires_grad and hasattr(param, "ds_id")):
        return None
    index = engine.optimizer.grad_position[engine.optimizer.get_param_id(param)][0]
    return index if index in swapped else None


def by_swapped_sub_group(engine, items: Iterable[Tuple[Any, torch.nn.Parameter]]
                         ) -> List[Tuple[Optional[int], List[Tuple[Any, torch.nn.Parameter]]]]:
    """``items`` (anything, parameter) in runs by the swapped sub-group holding each parameter's fp32 state: first
    the parameters held in memory (None), then each swapped sub-group's, in sub-group order. Without swapping, one run
    of all in their order. The same on every rank (ZeRO-3 forms sub-groups alike on all), so collectives match."""
    swapped = set(swapped_sub_groups(engine))
    runs: Dict[Optional[int], List[Tuple[Any, torch.nn.Parameter]]] = {None: []}
    for item in items:
        runs.setdefault(swapped_sub_group_of(engine, item[1], swapped), []).append(item)
    return [(None, runs.pop(None)), *sorted(runs.items())]


def held_in_memory(engine, params: Iterable[torch.nn.Parameter]
                   ) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """``params`` split into those whose fp32 state is held in memory and those in sub-groups swapped to NVMe."""
    swapped = set(swapped_sub_groups(engine))
    resident, elsewhere = [], []
    for param in params:
        (resident if swapped_sub_group_of(engine, param, swapped) is None else elsewhere).append(param)
    return resident, elsewhere


@contextlib.contextmanager
def resident_sub_group(engine, index: Optional[int], write: bool) -> Iterator[None]:
    """Keep swapped sub-group ``index`` in memory for the body (None: nothing to do), then write it back to its
    files when ``write``, else drop it. DeepSpeed's ``safe_get/set_full_*`` swap a sub-group in (and, to set, out)
    for every parameter and moment they touch: a whole sub-group's files read (and written) per parameter. Marked
    not swappable for the body, the sub-group is read in place instead, each file read once and written once."""
    if index is None:
        yield
        return
    optimizer = engine.optimizer
    optimizer._optimizer_states_and_gradient_swap_in(index)
    swappable = optimizer._swappable_optimizer_subgroup
    optimizer._swappable_optimizer_subgroup = lambda i: i != index and swappable(i)
    try:
        yield
    finally:
        del optimizer._swappable_optimizer_subgroup  # the class's method again
        if write:
            optimizer._optimizer_states_and_gradient_swap_out(index)
        else:
            optimizer._release_swap_buffers(index)


def set_zero3_partition(engine, param: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]
                        ) -> torch.Tensor:
    """Write this rank's partition of the full ``value`` of a ZeRO-3 ``param`` into its fp32 master (``key`` None) or
    its moment ``key``, in its sub-group, reading only that part of ``value``; returns the part written. A
    parameter no rank count divides has padded partitions: the last ranks get the elements there are, and the rest
    of the partition is left as it is (padding: a moment's is zeroed by ``moments.UnwrittenMoments.zero_rest``).
    DeepSpeed's ``safe_set_full_*`` (0.19.8) fail there, reading past the end of ``value``. A sub-group swapped to
    NVMe and not made resident by the caller is read in and written back around the write."""
    optimizer = engine.optimizer
    index, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    if optimizer._swappable_optimizer_subgroup(index):
        with resident_sub_group(engine, index, write=True):
            return set_zero3_partition(engine, param, value, key)
    flat = optimizer.fp32_partitioned_groups_flat[index]
    target = (flat if key is None else basic_optimizer(engine).state[flat][key]).narrow(0, offset, numel)
    start, count = real_span(param, numel, optimizer._get_param_partition_group(param))
    written = target.narrow(0, 0, count)
    with torch.no_grad():
        written.copy_(value.detach().reshape(-1).narrow(0, start, count))
    return written


def real_span(param: torch.nn.Parameter, numel: int, group) -> Tuple[int, int]:
    """(start in the full parameter, element count) of the real elements of this rank's ZeRO-3 partition of
    ``numel`` elements in process ``group``: the last ranks' partitions of a parameter no rank count divides are
    padded, fewer real elements or none."""
    start = numel * torch.distributed.get_rank(group=group)
    return start, max(0, min(param.ds_numel - start, numel))
