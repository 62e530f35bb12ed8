"""The optimizer state on NVMe in a ZeRO-3 checkpoint, which DeepSpeed 0.19.8's load and zero_to_fp32 leave
out: its swap files named per rank, read back. Writes no checkpoint file and checks none."""
from __future__ import annotations

import copy
import os
from typing import Dict, List, Optional

import torch

from .guard import check_places
from .layout import optimizer_state
from .moments import MOMENT_KEYS, unfilled
from .zero3 import resident_sub_group, swapped_sub_groups


def swapped_state_files(engine) -> Optional[Dict[str, List]]:
    """When the optimizer state is swapped to NVMe: this rank's ZeRO-3 sub-groups in order, as ``ids`` naming their
    files (``<id>.tensor.swp``, ``exp_avg-<id>.tensor.swp``, ...) and ``numels`` (elements of each fp32 master
    partition; DeepSpeed's ZeRO checkpoint file holds an empty tensor for a swapped one); None otherwise. DeepSpeed
    derives the id from the parameters' ``ds_id``, which count every parameter ZeRO-3 has partitioned in the
    process: an engine built after another (the real one after the delink) names its files otherwise than the one it
    resumes from did."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "swap_optimizer", False):
        return None
    return {"ids": [str(flat.ds_id) for flat in optimizer.fp32_partitioned_groups_flat],
            "numels": [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel],
            "folder": os.path.relpath(offloaded_checkpoint_folder(engine, "."), ".")}


def offloaded_checkpoint_folder(engine, checkpoint: str) -> str:
    """Where DeepSpeed's ``save_checkpoint`` copies this rank's swap files (``offloaded_tensors/rank<N>``)."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    return os.path.join(checkpoint, "offloaded_tensors", "rank" + dp_index_to_str(rank))


def _read_swap_file(path: str, into: torch.Tensor) -> None:
    """The first ``into.numel()`` elements of a swap file (raw tensor bytes, padded to the I/O alignment) into
    ``into``."""
    numel = into.numel()
    if os.path.getsize(path) < numel * into.element_size():
        raise RuntimeError(f"{path} holds {os.path.getsize(path)} bytes, fewer than the {numel} elements of "
                           f"{into.dtype} its sub-group has")
    with torch.no_grad():
        into.copy_(torch.from_file(path, shared=False, size=numel, dtype=into.dtype))


def restore_swapped_optimizer_state(engine, checkpoint: str, saved: Dict[str, List], moments: bool = True) -> None:
    """Put back, after DeepSpeed's ``load_checkpoint``, what a ZeRO-3 checkpoint with the optimizer state on NVMe
    holds of this rank's state and DeepSpeed 0.19.8 leaves unloaded: with ``offload_optimizer: nvme`` it skips its
    ZeRO checkpoint file and only copies the saved swap files into the swap folder. So the sub-groups it keeps in
    memory (under 1 MiB) get neither their fp32 masters nor their moments; the swapped ones get their masters, and
    only where the files' names (``saved``, the saving engine's :func:`swapped_state_files`) are this engine's, but
    never their moments (a new engine has no state to read them into). Each sub-group is restored here, a swapped
    one read in once and written back once: the fp32 master and the Adam moments from the ZeRO checkpoint file (held
    in memory) or the saved swap files (swapped), the step counter from the ZeRO checkpoint file, and the working
    partition from the master. ``moments`` False (a load without the optimizer state): the masters and working
    partitions only, the optimizer left without state as a new one is."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    optimizer = engine.optimizer
    flats = optimizer.fp32_partitioned_groups_flat
    zero_file = engine._get_zero_ckpt_name(os.path.dirname(checkpoint), os.path.basename(checkpoint))
    zero_state = torch.load(zero_file, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
    saved_flats, saved_optimizer = zero_state[FP32_FLAT_GROUPS], zero_state[OPTIMIZER_STATE_DICT]
    saved_ids, numels = saved["ids"], [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel]
    if len(saved_flats) != len(flats) or saved["numels"] != numels:
        raise RuntimeError(f"{zero_file} holds {len(saved_flats)} optimizer sub-groups of {saved['numels']} elements "
                           f"(the sidecar); this engine has {len(flats)} of {numels}")
    # the saved state is keyed as DeepSpeed lists the sub-groups in its param groups to save: by group, in order
    keys: Dict[int, int] = {}
    for group_id, group in enumerate(saved_optimizer["param_groups"]):
        members = [i for i in range(len(flats)) if optimizer.sub_group_to_group_id[i] == group_id]
        keys.update(zip(members, group["params"]))
    folder = os.path.join(checkpoint, saved["folder"])
    swapped = set(swapped_sub_groups(engine))
    optimizer.checkpoint_event_prologue()  # every parameter back to its partition (persistent ones too)
    for index, flat in enumerate(flats):
        state_saved = saved_optimizer["state"].get(keys.get(index), {}) if moments else {}
        with resident_sub_group(engine, index if index in swapped else None, write=True):
            files = {key: os.path.join(folder, f"{key}{saved_ids[index]}.tensor.swp")
                     for key in ("", *(k + "-" for k in MOMENT_KEYS))}
            if index in swapped:
                _read_swap_file(files[""], flat)
            else:
                with torch.no_grad():
                    flat.copy_(saved_flats[index])
            state = optimizer_state(engine, flat)
            for key in MOMENT_KEYS if "step" in state_saved else ():
                if key not in state or state[key].numel() != flat.numel():
                    state[key] = unfilled(flat.shape, flat.device).to(flat.dtype)
                if index in swapped:
                    _read_swap_file(files[key + "-"], state[key])
                else:
                    with torch.no_grad():
                        state[key].copy_(state_saved[key])
            if "step" in state_saved:
                state["step"] = copy.deepcopy(state_saved["step"])
            optimizer._reassign_or_swap_out_partitioned_parameters(index)  # the working partition from the master


def zero3_fp32_weights_with_swapped_masters(folder: str, saved: List[Dict[str, List]]) -> Dict[str, torch.Tensor]:
    """Full fp32 weights of a ZeRO-3 checkpoint ``folder`` whose optimizer state was swapped to NVMe, where
    DeepSpeed's ``zero_to_fp32`` stops (its ZeRO files hold an empty fp32 partition for each swapped sub-group):
    those partitions read from the checkpoint's copies of the swap files, named by ``saved`` (each rank's
    :func:`swapped_state_files`, from the sidecar), then merged by ``zero_to_fp32``'s own ZeRO-3 reader."""
    from deepspeed.utils import zero_to_fp32 as reader

    check_places("convert", {})
    model_states = reader.parse_model_states(reader.get_model_state_files(folder))
    stage, world, flats, _ = reader.parse_optim_states(reader.get_optim_files(folder), folder)
    if stage != 3 or world != len(saved):
        raise RuntimeError(f"{folder}: ZeRO stage {stage} on {world} ranks, but the sidecar names the swap files of "
                           f"{len(saved)} ZeRO-3 ranks")
    for rank, (groups, files) in enumerate(zip(flats, saved)):
        for index, numel in enumerate(files["numels"]):
            if groups[index].numel() == 0 and numel > 0:
                groups[index] = torch.empty(numel, dtype=torch.float32)
                _read_swap_file(os.path.join(folder, files["folder"], f"{files['ids'][index]}.tensor.swp"),
                                groups[index])
    state = reader._get_fp32_state_dict_from_zero3_checkpoint(world, flats, model_states, False)
    return reader.to_torch_tensor(state)


def regather_persistent_parameters(engine) -> None:
    """Collective, after :func:`restore_swapped_optimizer_state` on every rank: the parameters ZeRO-3 keeps whole on
    every rank (under its persistence threshold) gathered again from the restored partitions; until then they hold
    what DeepSpeed's own load gathered."""
    engine.optimizer.checkpoint_event_epilogue()
