"""A checkpoint's integrity: DeepSpeed's files checksummed as written, and the fingerprint of the state
a load is checked against. Changes no training state, chooses no checkpoint (DeepSpeed 0.19.8)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from .layout import optimizer_state, stepped_tensors, unique_parameters
from .moments import MOMENT_KEYS
from .zero3 import real_span, resident_sub_group, swapped_sub_groups


@contextlib.contextmanager
def checksummed_writes(engine, folder: str, snapshot: Optional[Callable[[Any], Any]] = None
                       ) -> Iterator[Dict[str, Any]]:
    """While DeepSpeed saves into ``folder``: its torch checkpoint engine writes each file through a checksumming,
    fsynced file object; yields {path relative to ``folder``: manifest entry} of this rank's files. A failed write
    raises the file system's OSError with the path. Other checkpoint engines write as they do (their files are
    checksummed when the checkpoint is published). The engine's ``save`` is shadowed on the instance for the
    duration only (DeepSpeed 0.19.8: every checkpoint file goes through ``engine.checkpoint_engine.save``).

    With ``snapshot`` (a function returning a copy of a state dict that later training leaves alone), nothing is
    written: yields {relative path: a function that writes that file's snapshot into a file object}, for a
    writer thread to pass to :func:`~ds_pseudo_real.checksums.save_with_checksum` (torch's engine only)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from ..checksums import save_with_checksum

    checkpoint_engine = engine.checkpoint_engine
    written: Dict[str, Any] = {}
    if type(checkpoint_engine) is not TorchCheckpointEngine:
        if snapshot is not None:
            raise RuntimeError(f"checkpoint.async_save needs DeepSpeed's TorchCheckpointEngine; this engine saves with "
                               f"{type(checkpoint_engine).__name__}")
        yield written
        return
    zipfile = checkpoint_engine.zipfile_serialization

    def save(state_dict, path: str) -> None:
        if snapshot is not None:
            copy = snapshot(state_dict)
            written[os.path.relpath(path, folder)] = lambda handle: torch.save(
                copy, handle, _use_new_zipfile_serialization=zipfile)
            return
        written[os.path.relpath(path, folder)] = save_with_checksum(
            lambda handle: torch.save(state_dict, handle, _use_new_zipfile_serialization=zipfile), path
        )

    checkpoint_engine.save = save
    try:
        yield written
    finally:
        del checkpoint_engine.save


def _sums(tensor: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """[sum, sum of squares] of ``tensor`` in float64, on the CPU; converted a chunk at a time into one float64
    buffer, so that no float64 copy of a large tensor is made (8x faster on the host here than converting it whole)
    and no memory is allocated per chunk (each allocation's pages faulted in again: several times slower right
    after a checkpoint's files filled the page cache)."""
    flat = tensor.detach().reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    buffer = torch.empty(min(chunk, flat.numel()), dtype=torch.float64, device=flat.device)
    for part in flat.split(chunk):
        values = buffer[:part.numel()]
        values.copy_(part)
        total += torch.stack([values.sum(), values.dot(values)])
    return total.cpu()


def fingerprint_terms(engine, take: Callable[[torch.Tensor], Any]) -> Optional[Dict[str, list]]:
    """``take`` of each tensor :func:`state_fingerprint` sums, while it is in memory: ``weights``, a list over the
    working parameters; ``optimizer``, a list of [tensor the optimizer steps, then each Adam moment or None] lists.
    None when some working parameters are not in memory (ZeRO-3 ``offload_param: nvme``). A sub-group ZeRO-3
    swaps to NVMe is read in once."""
    weights = []
    for param in unique_parameters(engine.module.parameters()):
        local = getattr(param, "ds_tensor", None)
        if local is None:
            weights.append(take(param))
            continue
        numel = local.numel()
        if numel == 0 and param.ds_numel > 0:
            return None
        _, count = real_span(param, numel, engine.optimizer._get_param_partition_group(param))
        weights.append(take(local.reshape(-1).narrow(0, 0, count)))
    optimizer = []
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    swapped = {id(flats[i]): i for i in swapped_sub_groups(engine)}
    for _, tensor in stepped_tensors(engine):
        with resident_sub_group(engine, swapped.get(id(tensor)), write=False):
            state = optimizer_state(engine, tensor)
            optimizer.append([take(tensor)] + [take(state[k]) if k in state else None for k in MOMENT_KEYS])
    return {"weights": weights, "optimizer": optimizer}


def _total(sums: Optional[Dict[str, list]]) -> Optional[Dict[str, List[float]]]:
    """The fingerprint from :func:`fingerprint_terms` taken as :func:`_sums` (None for a missing moment)."""
    if sums is None:
        return None
    missing = torch.zeros(2, dtype=torch.float64)
    weights = sum(sums["weights"], torch.zeros(2, dtype=torch.float64))
    optimizer = sum((torch.cat([s if s is not None else missing for s in row]) for row in sums["optimizer"]),
                    torch.zeros(2 + 2 * len(MOMENT_KEYS), dtype=torch.float64))
    return {"weights": weights.tolist(), "optimizer": optimizer.tolist()}


def fingerprint_of(terms: Optional[Dict[str, list]]) -> Optional[Dict[str, List[float]]]:
    """The fingerprint of the tensors :func:`fingerprint_terms` took (copies of them), in any thread."""
    if terms is None:
        return None
    return _total({"weights": [_sums(t) for t in terms["weights"]],
                   "optimizer": [[_sums(t) if t is not None else None for t in row] for row in terms["optimizer"]]})


def state_fingerprint(engine) -> Optional[Dict[str, List[float]]]:
    """What this rank holds of the training state, as sums and sums of squares in float64: ``weights``, of the
    working parameters (its ZeRO-3 partitions' real elements, else every parameter whole), and ``optimizer``, of
    every tensor the optimizer steps (fp32 masters, flat partitions with their padding) and of each of its Adam
    moments. Saved with a checkpoint and compared after a load, it tells whether the load restored them. None when
    some working parameters are not in memory (ZeRO-3 ``offload_param: nvme``): nothing to compare."""
    return _total(fingerprint_terms(engine, _sums))
