"""Reading and writing a DeepSpeed engine's full fp32 weights and Adam state, for every ZeRO stage.

Owns every use of DeepSpeed internals by the plugin (written against DeepSpeed 0.19.8), listed by feature in
:data:`DEEPSPEED_INTERNALS` and checked on each engine as it is built (:func:`check_internals`): ``safe_get/set_full_*``
for ZeRO 1-3 and the bf16 optimizer, direct access for the plain fp32 optimizer of ZeRO stage 0, seeding the
lazily created optimizer state so moments can be set before the first step, the per-rank byte accounting, and
folding the norm of gradients DeepSpeed does not hold (granular offload's own groups) into its global gradient
norm and its overflow decision and dropping them when it zeroes its own, by wrapping methods on the engine's own
optimizer instance (its norm, the unfused optimizer's overflow check, ``zero_grad``: they live and die with that
engine), checksumming the files its checkpoint engine writes, keeping one monitor per run, rewound to the step a run
resumes from (:func:`rewind_monitors`), and warning instead of raising when it cannot write
(:func:`warn_on_failed_monitor_writes`). One class-level patch: the model broadcast at
initialize sends host tensors (granular offload's host_params) through the device under NCCL
(:func:`route_host_broadcasts`, undone by :func:`unroute_host_broadcasts`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
from deepspeed.runtime.utils import combine_grad_norm_groups
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from .sharing import fill_copies

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# The releases this module's uses of DeepSpeed and torch internals were written and tested against: [low, high).
SUPPORTED_VERSIONS = {"deepspeed": ("0.19.0", "0.20.0"), "torch": ("2.4.0", "2.15.0")}
# The DeepSpeed internals each feature of the plugin reads or wraps (DeepSpeed 0.19.8), by where they live: the
# engine, a module, the checkpoint engine it saves through, the CPU Adam object whose kernel granular offload calls,
# and under "engine.optimizer" the class of ``engine.optimizer`` (matched by name along its MRO), where
# "parameters.<name>" is an attribute the model's parameters get under that optimizer. An engine whose optimizer is
# none of a feature's classes is refused: the plugin does not know where it keeps its state. Checked when the engine
# is built by :func:`check_internals` (:func:`check_cpu_adam` for the CPU Adam object).
OPTIMIZER_AS_GIVEN = "the torch optimizer as given"  # ZeRO 0 in fp32: the engine steps the optimizer it was given
_FLAT_FRAGMENTS = ("_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked", "parameters._hp_mapping")
DEEPSPEED_INTERNALS: Dict[str, Dict[str, Any]] = {
    "pseudo_to_real": {  # full weights and moments read and written at a transition, the byte report, the counters
        "DeepSpeedEngine": ("global_steps", "global_samples", "micro_steps", "skipped_steps", "monitor",
                            "get_data_types", "destroy",
                            "_get_zero_ckpt_name", "use_node_local_storage", "local_rank", "global_rank"),
        "deepspeed.utils.groups": ("_get_expert_data_parallel_group",),  # the report's parameters over all ranks
        "engine.optimizer": {
            "DeepSpeedZeroOptimizer": _FLAT_FRAGMENTS,
            "BF16_Optimizer": _FLAT_FRAGMENTS,
            "DeepSpeedZeroOptimizer_Stage3": ("fp32_partitioned_groups_flat", "sub_group_to_group_id",
                                              "grad_position", "get_param_id", "swap_optimizer",
                                              "_swappable_optimizer_subgroup",  # NVMe: one sub-group at a time
                                              "_optimizer_states_and_gradient_swap_in",
                                              "_optimizer_states_and_gradient_swap_out", "_release_swap_buffers",
                                              "_get_param_partition_group",
                                              # a load under NVMe: the sub-groups' masters and moments restored
                                              "fp16_partitioned_groups_flat_numel",
                                              "_reassign_or_swap_out_partitioned_parameters",
                                              "checkpoint_event_prologue", "checkpoint_event_epilogue",
                                              "parameters.ds_id", "parameters.ds_tensor", "parameters.ds_numel"),
            "FP16_UnfusedOptimizer": ("fp16_groups", "fp32_groups"),
            OPTIMIZER_AS_GIVEN: (),
        },
    },
    "save_checkpoint": {  # every file checksummed as DeepSpeed writes it
        "DeepSpeedEngine": ("checkpoint_engine",),
        "TorchCheckpointEngine": ("save", "zipfile_serialization"),
    },
    "granular_offload": {  # its own groups (host_params outside DeepSpeed's optimizer): norm, overflow, zero_grad
        "DeepSpeedEngine": ("communication_data_type",),
        "deepspeed.utils.groups": ("_get_data_parallel_group", "_get_expert_data_parallel_group"),
        "DeepSpeedCPUAdam": ("ds_opt_adam.adam_update", "opt_id"),
        "engine.optimizer": {
            "DeepSpeedZeroOptimizer": ("scaled_global_norm", "_global_grad_norm", "loss_scale", "zero_grad"),
            # and its _global_grad_norm, which it sets at its first step only
            "BF16_Optimizer": ("get_grads_for_norm", "bf16_groups", "zero_grad"),
            "FP16_UnfusedOptimizer": ("unscale_and_clip_grads", "fp32_groups", "overflow_checker.check",
                                      "loss_scale_config.cur_scale", "_global_grad_norm", "zero_grad",
                                      "initialize_optimizer_states"),
            OPTIMIZER_AS_GIVEN: (),  # fp32 ZeRO 0 has no own groups
        },
    },
    "convert": {  # a ZeRO-3 checkpoint with the optimizer state on NVMe: the swapped fp32 partitions filled in
        "deepspeed.utils.zero_to_fp32": ("parse_model_states", "get_model_state_files", "parse_optim_states",
                                         "get_optim_files", "_get_fp32_state_dict_from_zero3_checkpoint",
                                         "to_torch_tensor"),
    },
    # the model broadcast at initialize, through the device under NCCL; ZeRO 0's all-reduce, given device gradients
    "granular_offload host_params": {
        "DeepSpeedEngine": ("_broadcast_model", "allreduce_gradients"),
        "deepspeed.comm": ("broadcast",),
    },
    "monitors": {  # one writer per run across engines, rewound to the step a run resumes from (rank 0's monitor);
        # a failed write (a full disk) is a warning, not an exception out of engine.step
        "DeepSpeedEngine": ("monitor", "monitor.write_events"),
        "MonitorMaster": ("tb_monitor", "csv_monitor"),
        "TensorBoardMonitor": ("summary_writer",),
        "csvMonitor": ("log_dir", "filenames"),
    },
}
_PARAMETERS = "parameters."


def check_versions(feature: str) -> None:
    """Refuse to run ``feature`` on a DeepSpeed or torch release outside :data:`SUPPORTED_VERSIONS`: the internals
    it reaches into may have moved, and a silent difference there would train wrongly."""
    import deepspeed
    from packaging.version import Version

    for name, found in (("deepspeed", deepspeed.__version__), ("torch", torch.__version__)):
        low, high = SUPPORTED_VERSIONS[name]
        if not Version(low) <= Version(Version(found).base_version) < Version(high):
            raise RuntimeError(f"{feature} was written against {name} >={low},<{high}; found {name} {found}. "
                               f"Install a supported release (pip install '{name}>={low},<{high}')")


def _missing_internal(feature: str, what: str, problem: str) -> RuntimeError:
    import deepspeed

    low, high = SUPPORTED_VERSIONS["deepspeed"]
    return RuntimeError(f"{feature} uses {what}, which this DeepSpeed {problem} (found deepspeed "
                        f"{deepspeed.__version__}; the plugin was written against deepspeed >={low},<{high}). Install "
                        f"a supported release (pip install 'deepspeed>={low},<{high}')")


def _has_path(owner, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True


def _check_places(feature: str, places: Dict[str, Any]) -> None:
    """Check the entries of ``feature`` for the ``places`` given (name -> object) and its modules; entries for places
    not given (another checkpoint engine, the CPU Adam object of :func:`check_cpu_adam`) are not this call's."""
    import importlib

    for where, paths in DEEPSPEED_INTERNALS[feature].items():
        if where.startswith("deepspeed."):
            try:
                owner = importlib.import_module(where)
            except ImportError:
                raise _missing_internal(feature, where, "does not have") from None
        elif where in places:
            owner = places[where]
        else:
            continue
        for path in paths:
            if not _has_path(owner, path):
                raise _missing_internal(feature, f"{where}.{path}", "does not have")


def check_internals(engine, *features: str) -> None:
    """Refuse, when ``engine`` is built, what ``features`` (keys of :data:`DEEPSPEED_INTERNALS`) would get wrong: an
    internal they use that this DeepSpeed does not have, or an optimizer class whose state they do not know. Either
    would fail obscurely mid-run or train silently wrongly (a ``copy`` of the moments becoming a ``reset``). The
    RuntimeError names the attribute (``DeepSpeedZeroOptimizer.scaled_global_norm``) or the class, the DeepSpeed
    release found and the supported range."""
    optimizer = engine.optimizer
    places = {}
    for instance in (getattr(engine, "checkpoint_engine", None), engine):
        places.update({cls.__name__: instance for cls in type(instance).__mro__})
    for feature in features:
        _check_places(feature, places)
        wrappers = DEEPSPEED_INTERNALS[feature].get("engine.optimizer", {})
        if not wrappers:
            continue
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's wrappers are not
            wrapper = OPTIMIZER_AS_GIVEN
        else:
            wrapper = next((cls.__name__ for cls in type(optimizer).__mro__ if cls.__name__ in wrappers), None)
        if wrapper is None:
            import deepspeed

            known = sorted(set(wrappers) - {OPTIMIZER_AS_GIVEN})
            raise RuntimeError(
                f"{feature} was written for engines whose optimizer is one of {known} or {OPTIMIZER_AS_GIVEN}; "
                f"this engine's is {type(optimizer).__name__} (ZeRO stage {engine.zero_optimization_stage()}, "
                f"deepspeed {deepspeed.__version__}), whose internals it does not know. At ZeRO stage 0 in bf16 or "
                f"fp16, a torch optimizer (optimizer.params.torch_adam: true, or a client optimizer) gives "
                f"FP16_UnfusedOptimizer where DeepSpeed's fused Adam gives FP16_Optimizer")
        for path in wrappers[wrapper]:
            if path.startswith(_PARAMETERS):
                name = path[len(_PARAMETERS):]
                if not any(hasattr(p, name) for p in engine.module.parameters()):
                    raise _missing_internal(feature, f"Parameter.{name} (under {wrapper})",
                                            "sets on no parameter of the model")
            elif not _has_path(optimizer, path):
                raise _missing_internal(feature, f"{wrapper}.{path}", "does not have")


def check_cpu_adam(cpu_adam, feature: str = "granular_offload") -> None:
    """:func:`check_internals` for the ``DeepSpeedCPUAdam`` whose kernel ``feature`` calls directly
    (``ds_opt_adam.adam_update(opt_id, ...)``)."""
    _check_places(feature, {"DeepSpeedCPUAdam": cpu_adam})


def basic_optimizer(engine) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer that holds the state: ZeRO and the bf16 optimizer wrap it as ``.optimizer``."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _is_managed(param: torch.nn.Parameter) -> bool:
    """True when DeepSpeed maps ``param`` onto flat fp32 partitions (ZeRO 1-3, bf16 optimizer): use safe_*."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _master(engine, param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor the optimizer steps for an unmanaged ``param``: itself, or the fp32 copy kept by the
    stage-0 mixed-precision optimizers (``fp16_groups``/``fp32_groups`` in parallel lists)."""
    optimizer = engine.optimizer
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if low is None or high is None:
        return param
    for low_group, high_group in zip(low, high):
        for low_param, high_param in zip(low_group, high_group):
            if low_param is param:
                return high_param
    return param


def _optimizer_state(engine, tensor: torch.Tensor) -> Dict[str, Any]:
    """The state entry of ``tensor``: granular offload keeps its own groups' states outside ``.state``."""
    optimizer = basic_optimizer(engine)
    return optimizer.state_of(tensor) if hasattr(optimizer, "state_of") else optimizer.state[tensor]


def _stepped_tensors(engine):
    """(group index, tensor) for every tensor whose optimizer state exists. ZeRO-3 keeps its flat fp32
    sub-groups outside ``param_groups`` between steps, so they are listed from the ZeRO optimizer; granular
    offload's own groups (outside DeepSpeed's optimizer) follow the param groups."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        groups = getattr(engine.optimizer, "sub_group_to_group_id", {})
        return [(groups.get(i, 0), t) for i, t in enumerate(flats)]
    optimizer = basic_optimizer(engine)
    groups = list(optimizer.param_groups) + list(getattr(optimizer, "own_param_groups", []))
    return [(i, t) for i, g in enumerate(groups) for t in g["params"]]


def _own_copy(value: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """A new fp32 tensor on ``device`` (the CPU when None) holding ``value``: one copy, never a view of it."""
    return value.detach().to(device or "cpu", torch.float32, copy=True)


def full_fp32_param(engine, param: torch.nn.Parameter, device: Optional[torch.device] = None) -> torch.Tensor:
    """The full fp32 value of ``param`` on ``device`` (the CPU when None). A collective under ZeRO-3: call on every
    rank, same order."""
    own_master = getattr(basic_optimizer(engine), "fp32_master", None)
    value = own_master(param) if own_master is not None else None
    if value is None:
        value = safe_get_full_fp32_param(param) if _is_managed(param) else _master(engine, param)
    return _own_copy(value, device)


def set_full_fp32_param(engine, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write the full fp32 ``value`` of ``param`` into the fp32 master its optimizer steps (this rank's part of it
    under ZeRO 1-3, granular offload's host master for its own groups); the working parameter is left as it is."""
    own_master = getattr(basic_optimizer(engine), "fp32_master", None)
    master = own_master(param) if own_master is not None else None
    if master is None and hasattr(param, "ds_id"):
        _set_zero3_partition(engine, param, value, None)
        return
    if master is None and _is_managed(param):
        safe_set_full_fp32_param(param, value)
        return
    if master is None:
        master = _master(engine, param)
    with torch.no_grad():
        master.copy_(value)


def full_moments(engine, param: torch.nn.Parameter, name: str = "", device: Optional[torch.device] = None
                 ) -> Optional[Dict[str, torch.Tensor]]:
    """``exp_avg``/``exp_avg_sq`` of ``param`` (full, fp32, on ``device``: the CPU when None), or None when it has
    none yet: it is frozen, or its optimizer has not stepped it. Moments its optimizer should hold but that cannot be
    read (DeepSpeed failing after the first step, a state without Adam moments) are a RuntimeError naming the
    parameter, never a silent ``reset``."""
    what = name or "a parameter"
    if not param.requires_grad:
        return None
    if _is_managed(param):
        try:
            values = {k: safe_get_full_optimizer_state(param, k) for k in MOMENT_KEYS}
        except (KeyError, TypeError, ValueError) as error:
            if not basic_optimizer(engine).state:
                return None  # no state yet: DeepSpeed creates and links it at this optimizer's first step
            raise RuntimeError(f"cannot read the Adam moments of {what} from DeepSpeed, whose optimizer has stepped "
                               f"({type(error).__name__}: {error}); the delink would silently reset them") from error
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise RuntimeError(f"cannot read the Adam moments of {what}: DeepSpeed gives no {missing} for this "
                               f"trainable parameter; the delink would silently reset them")
        return {k: _own_copy(v, device) for k, v in values.items()}
    state = _optimizer_state(engine, _master(engine, param))
    if not state:
        return None
    if not all(k in state for k in MOMENT_KEYS):
        raise RuntimeError(f"cannot read the Adam moments of {what}: its optimizer state holds {sorted(state)}, not "
                           f"{list(MOMENT_KEYS)}; pseudo_to_real.optimizer_state 'copy' and 'scale' carry Adam "
                           f"moments, accepted with this optimizer: 'reset'")
    return {k: _own_copy(state[k], device) for k in MOMENT_KEYS}


def step_counters(engine) -> Dict[str, Any]:
    """The optimizer's step counters, in whatever form its class keeps them (per state entry and/or per group).

    ``state_step`` is the highest count among the state entries: torch's Adam/AdamW and DeepSpeed's CPU Adam count in
    every entry alike, but DeepSpeed's FusedAdam counts only in the entry of the last parameter of each group it steps
    (the others keep the count they were created with) and steps the whole group with that count."""
    optimizer = basic_optimizer(engine)
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    state_step = max(steps, key=float) if steps else None
    return {
        "state_step": copy.deepcopy(state_step),
        "group_steps": [copy.deepcopy(g.get("step")) for g in optimizer.param_groups],
    }


def unfilled(shape, device, pin_memory: bool = False) -> torch.Tensor:
    """New contiguous fp32 memory, left as the allocator gives it: for moments the delink writes next (pinned host
    memory: granular offload's, at its exact size)."""
    if pin_memory:
        from ds_pseudo_real.offload.pinned import host_empty

        return host_empty(shape, torch.float32, pin=True)
    return torch.empty(shape, dtype=torch.float32, device=device)


def swapped_sub_groups(engine) -> List[int]:
    """The sub-groups a ZeRO-3 optimizer swaps to NVMe (``offload_optimizer: nvme``): their fp32 master and moments
    live in files and are in memory only while DeepSpeed steps them (smaller ones, under 1 MiB, stay in memory)."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "swap_optimizer", False):
        return []
    return [i for i in range(len(optimizer.fp32_partitioned_groups_flat)) if optimizer._swappable_optimizer_subgroup(i)]


def _swapped_sub_group_of(engine, param: torch.nn.Parameter, swapped) -> Optional[int]:
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
        runs.setdefault(_swapped_sub_group_of(engine, item[1], swapped), []).append(item)
    return [(None, runs.pop(None)), *sorted(runs.items())]


def held_in_memory(engine, params: Iterable[torch.nn.Parameter]
                   ) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """``params`` split into those whose fp32 state is held in memory and those in sub-groups swapped to NVMe."""
    swapped = set(swapped_sub_groups(engine))
    resident, elsewhere = [], []
    for param in params:
        (resident if _swapped_sub_group_of(engine, param, swapped) is None else elsewhere).append(param)
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
    only where the files' names (``saved``, the saving engine's :func:`swapped_state_files`) are this engine's, but never
    their moments (a new engine has no state to read them into). Each sub-group is restored here, a swapped one read
    in once and written back once: the fp32 master and the Adam moments from the ZeRO checkpoint file (held in memory)
    or the saved swap files (swapped), the step counter from the ZeRO checkpoint file, and the working partition
    from the master. ``moments`` False (a load without the optimizer state): the masters and working partitions
    only, the optimizer left without state as a new one is."""
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
            state = _optimizer_state(engine, flat)
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


def replay_cpu_adam_steps(engine) -> None:
    """Bring the bias correction of the engine's DeepSpeed CPU Adam kernel (ZeRO's ``offload_optimizer``) to where a
    run that stepped it from step 1 has it, for a new engine that starts at a later step: after a delink carries the
    step counters, or a load restores them. The kernel (``Adam_Optimizer::IncrementStep``) multiplies beta^t by beta
    at each new step but recomputes it with pow() after a jump, which differs in the last bit (beta2 = 0.999: at steps
    3 and 6 from step 1; at steps 4, 5, 7 and 8 from a first step at 3), so an engine started at a later step would
    leave the trajectory of the run it continues. Granular offload's kernel is replayed by its own optimizer
    (``HostAdam.replay_kernel_steps``)."""
    optimizer = basic_optimizer(engine)
    kernel, opt_id = getattr(optimizer, "ds_opt_adam", None), getattr(optimizer, "opt_id", None)
    if kernel is None or opt_id is None:
        return
    step = step_counters(engine)["state_step"]
    replay_kernel_steps(optimizer, int(step.item()) if torch.is_tensor(step) else int(step or 0),
                        optimizer.param_groups[0])


def replay_kernel_steps(cpu_adam, last_step: int, group: Dict[str, Any]) -> None:
    """Steps 1..``last_step`` of ``cpu_adam``'s kernel with lr and weight decay 0 on a one-element dummy: only its
    bias correction (beta^t, a product over the steps it has seen) moves, to where a run from step 1 has it."""
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(1) for _ in range(4)]
    for step in range(1, last_step + 1):
        cpu_adam.ds_opt_adam.adam_update(cpu_adam.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                         group["bias_correction"], *dummy)


def zero3_fp32_weights_with_swapped_masters(folder: str, saved: List[Dict[str, List]]) -> Dict[str, torch.Tensor]:
    """Full fp32 weights of a ZeRO-3 checkpoint ``folder`` whose optimizer state was swapped to NVMe, where
    DeepSpeed's ``zero_to_fp32`` stops (its ZeRO files hold an empty fp32 partition for each swapped sub-group):
    those partitions read from the checkpoint's copies of the swap files, named by ``saved`` (each rank's
    :func:`swapped_state_files`, from the sidecar), then merged by ``zero_to_fp32``'s own ZeRO-3 reader."""
    from deepspeed.utils import zero_to_fp32 as reader

    _check_places("convert", {})
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


def _storage_address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class UnwrittenMoments:
    """The moments :func:`seed_optimizer_state` left unfilled, and the spans of their memory written since: whatever
    is still unwritten when the carry ends is zeroed by :meth:`zero_rest` (a flat partition's padding, a parameter
    whose source had no moments). Spans are kept per storage, so moments that are views of one flat buffer (granular
    offload's host buffers) and writes through other views of it (DeepSpeed's fragments) meet."""

    def __init__(self) -> None:
        self._moments: Dict[int, List[torch.Tensor]] = {}  # by storage address: the moments left unfilled in it
        self._written: Dict[int, List[Tuple[int, int]]] = {}  # by storage address: (start, end) elements written

    def add(self, moment: torch.Tensor) -> None:
        if not moment.is_contiguous():
            moment.zero_()
        elif moment.numel():
            self._moments.setdefault(_storage_address(moment), []).append(moment)

    def wrote(self, part: torch.Tensor) -> None:
        """``part``, a contiguous tensor in the memory of a moment (the moment, or a view of it), now holds values."""
        address = _storage_address(part) if part.numel() else None
        if address in self._moments:
            start = part.storage_offset()
            self._written.setdefault(address, []).append((start, start + part.numel()))

    def zero_rest(self) -> None:
        for address, moments in self._moments.items():
            spans = sorted(self._written.get(address, []))
            for moment in moments:
                flat, base = moment.view(-1), moment.storage_offset()
                at, end = base, base + moment.numel()
                for start, stop in spans:
                    if start >= end:
                        break
                    if start > at:
                        flat[at - base:start - base].zero_()
                    at = max(at, stop)
                if at < end:
                    flat[at - base:].zero_()
        self._moments.clear()
        self._written.clear()


def seed_optimizer_state(engine, counters: Dict[str, Any]) -> UnwrittenMoments:
    """Create moments and the given step counters for every tensor the optimizer steps; returns the moments left
    unfilled, for :func:`set_full_moments_of_copies` to write and :meth:`UnwrittenMoments.zero_rest` to zero where
    it did not.

    Optimizers create their state lazily at the first step, and DeepSpeed links its per-parameter views of the
    flat fp32 partitions to that state only then; seeding first makes the moments settable before any step.
    The carry writes every moment it has a source for, so the moments are allocated unfilled: one pass over their
    bytes instead of two. That covers a tensor stepped with a state of its own (ZeRO 0: the parameter, or the unfused
    optimizer's fp32 copy of it), written whole, and DeepSpeed's flat partitions of ZeRO 1/2 and the bf16 optimizer,
    written a parameter's fragment at a time, ZeRO-3's sub-groups, written a parameter's partition at a time, and
    granular offload's states (``seed_states``: each group's state where its level steps it). Sub-groups that ZeRO-3
    swaps to NVMe are :func:`write_swapped_moments`'s: their state can be made only while they are in memory.
    """
    optimizer = basic_optimizer(engine)
    unwritten = UnwrittenMoments()
    seed_states = getattr(optimizer, "seed_states", None)
    if seed_states is not None:
        steps = [counters["state_step"], *counters["group_steps"]]
        seed_states(next((s for s in steps if s is not None), 0), unwritten)
        relink_optimizer_state(engine)
        return unwritten
    group_steps = counters["group_steps"]
    for index, group in enumerate(optimizer.param_groups):
        step = group_steps[index] if index < len(group_steps) else group_steps[-1] if group_steps else None
        if step is not None:
            group["step"] = copy.deepcopy(step)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    swapped = {id(flats[i]) for i in swapped_sub_groups(engine)}  # seeded by write_swapped_moments, in memory
    for _, tensor in _stepped_tensors(engine):
        if id(tensor) not in swapped:
            _seed_state(engine, tensor, counters, unwritten)
    relink_optimizer_state(engine)
    return unwritten


def _seed_state(engine, tensor: torch.Tensor, counters: Dict[str, Any], unwritten: UnwrittenMoments) -> None:
    state = _optimizer_state(engine, tensor)
    for key in MOMENT_KEYS:
        state[key] = unfilled(tensor.shape, tensor.device)
        unwritten.add(state[key])
    if counters["state_step"] is not None:
        state["step"] = copy.deepcopy(counters["state_step"])


def write_swapped_moments(engine, counters: Dict[str, Any],
                          copies: Iterable[Tuple[Iterable[torch.nn.Parameter], Dict[str, torch.Tensor]]]) -> None:
    """The carry into the sub-groups ZeRO-3 swaps to NVMe, which :func:`seed_optimizer_state` leaves alone: for each
    (parameters, the moments to write into each of them) of ``copies`` that lie in such a sub-group (the others are
    :func:`set_full_moments_of_copies`'s), one sub-group at a time, read in, given unfilled moments and the step
    counter, written, zeroed where nothing was written (padding, parameters without a source), written back to its
    files. Every swapped sub-group is seeded, those without a carried parameter too, so that all continue at the
    same step."""
    swapped = swapped_sub_groups(engine)
    if not swapped:
        return
    pending: Dict[int, List[Tuple[torch.nn.Parameter, Dict[str, torch.Tensor]]]] = {}
    for params, moments in copies:
        for param in params:
            index = _swapped_sub_group_of(engine, param, swapped)
            if index is not None:
                pending.setdefault(index, []).append((param, moments))
    flats = engine.optimizer.fp32_partitioned_groups_flat
    for index in swapped:
        with resident_sub_group(engine, index, write=True):
            unwritten = UnwrittenMoments()
            _seed_state(engine, flats[index], counters, unwritten)
            for param, moments in pending.pop(index, []):
                set_full_moments_of_copies(engine, [param], moments, unwritten)
            unwritten.zero_rest()


def relink_optimizer_state(engine) -> None:
    """Point every parameter's optimizer-state fragment at the current flat state tensors.

    ZeRO-1/2 and the bf16 optimizer link the fragments once, right after the FIRST parameter group's first step,
    when the other groups have no state yet: their fragments stay empty (DeepSpeed 0.19.8), so
    ``safe_get_full_optimizer_state`` fails for them until relinked.
    """
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None and basic_optimizer(engine).state:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def set_full_moments_of_copies(engine, params: Iterable[torch.nn.Parameter], moments: Dict[str, torch.Tensor],
                               unwritten: Optional[UnwrittenMoments] = None) -> None:
    """Write the same full fp32 ``moments`` into every parameter of ``params`` (the copies of one shared parameter,
    after :func:`seed_optimizer_state`, whose ``unwritten`` record these writes go into): the states of their own
    together, each piece of the moments read once (:func:`~ds_pseudo_real.sharing.fill_copies`, which refuses a
    moment of another shape); DeepSpeed's flat partitions one parameter after another, each reading only the
    fragment this rank holds."""
    states = {key: [] for key in MOMENT_KEYS}
    for param in params:
        if hasattr(param, "ds_id"):
            for key in MOMENT_KEYS:
                written = _set_zero3_partition(engine, param, moments[key], key)
                if unwritten is not None:
                    unwritten.wrote(written)
            continue
        if _is_managed(param):
            for key in MOMENT_KEYS:
                safe_set_full_optimizer_state(param, moments[key].to(param.device), key)
                if param._hp_mapping is not None and unwritten is not None:  # None: this rank holds none of it
                    unwritten.wrote(param._hp_mapping.get_optim_state_fragment(key))
            continue
        state = _optimizer_state(engine, _master(engine, param))
        for key in MOMENT_KEYS:
            states[key].append(state[key])
    for key, targets in states.items():
        if targets:
            fill_copies(targets, moments[key])
            if unwritten is not None:
                for target in targets:
                    unwritten.wrote(target)


def _set_zero3_partition(engine, param: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]
                         ) -> torch.Tensor:
    """Write this rank's partition of the full ``value`` of a ZeRO-3 ``param`` into its fp32 master (``key`` None) or
    its moment ``key``, in its sub-group, reading only that part of ``value``; returns the part written. A
    parameter no rank count divides has padded partitions: the last ranks get the elements there are, and the rest
    of the partition is left as it is (padding: a moment's is zeroed by :meth:`UnwrittenMoments.zero_rest`).
    DeepSpeed's ``safe_set_full_*`` (0.19.8) fail there, reading past the end of ``value``. A sub-group swapped to
    NVMe and not made resident by the caller is read in and written back around the write."""
    optimizer = engine.optimizer
    index, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    if optimizer._swappable_optimizer_subgroup(index):
        with resident_sub_group(engine, index, write=True):
            return _set_zero3_partition(engine, param, value, key)
    flat = optimizer.fp32_partitioned_groups_flat[index]
    target = (flat if key is None else basic_optimizer(engine).state[flat][key]).narrow(0, offset, numel)
    start, count = _real_span(param, numel, optimizer._get_param_partition_group(param))
    written = target.narrow(0, 0, count)
    with torch.no_grad():
        written.copy_(value.detach().reshape(-1).narrow(0, start, count))
    return written


def _real_span(param: torch.nn.Parameter, numel: int, group) -> Tuple[int, int]:
    """(start in the full parameter, element count) of the real elements of this rank's ZeRO-3 partition of
    ``numel`` elements in process ``group``: the last ranks' partitions of a parameter no rank count divides are
    padded, fewer real elements or none."""
    start = numel * torch.distributed.get_rank(group=group)
    return start, max(0, min(param.ds_numel - start, numel))


def _local_numel(param: torch.nn.Parameter) -> int:
    """Elements this rank stores for ``param`` (its ZeRO-3 partition, or all of it)."""
    partition = getattr(param, "ds_tensor", None)
    return partition.numel() if partition is not None else param.numel()


def memory_report(engine) -> Dict[str, int]:
    """Bytes this rank holds: working parameters, gradients, fp32 masters and optimizer state.

    Parameters, masters and optimizer state are read off the tensors; gradients are what the ZeRO stage keeps
    between backward and step (full for stages 0-1, this rank's partition for 2-3) in DeepSpeed's gradient
    accumulation dtype: an expectation, not a reading.
    """
    params = _unique(engine.module.parameters())
    param_bytes = sum(_local_numel(p) * p.element_size() for p in params)
    optimizer = basic_optimizer(engine)
    master_tensors = [t for _, t in _stepped_tensors(engine)]
    module_ids = {id(p) for p in params}
    master_bytes = sum(t.numel() * t.element_size() for t in master_tensors if id(t) not in module_ids)
    states = list(optimizer.state.values()) + list(getattr(optimizer, "own_state", {}).values())
    state_bytes = sum(v.numel() * v.element_size() for s in states for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    stage = engine.zero_optimization_stage()
    grad_elements = sum(t.numel() for t in master_tensors) if stage >= 2 else sum(p.numel() for p in params)
    grad_size = torch.empty((), dtype=engine.get_data_types()[1]).element_size()
    return {
        "parameters": param_bytes,
        "gradients": grad_elements * grad_size,
        "fp32_master": master_bytes,
        "optimizer_state": state_bytes,
    }


def _sums(tensor: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """[sum, sum of squares] of ``tensor`` in float64, on the CPU; converted a chunk at a time, so that no float64
    copy of a large tensor is made (8x faster on the host here than converting it whole)."""
    total = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    for part in tensor.detach().reshape(-1).split(chunk):
        values = part.to(torch.float64)
        total += torch.stack([values.sum(), values.dot(values)])
    return total.cpu()


def state_fingerprint(engine) -> Optional[Dict[str, List[float]]]:
    """What this rank holds of the training state, as sums and sums of squares in float64: ``weights``, of the
    working parameters (its ZeRO-3 partitions' real elements, else every parameter whole), and ``optimizer``, of
    every tensor the optimizer steps (fp32 masters, flat partitions with their padding) and of each of its Adam
    moments. Saved with a checkpoint and compared after a load, it tells whether the load restored them. None when
    some working parameters are not in memory (ZeRO-3 ``offload_param: nvme``): nothing to compare. A sub-group
    ZeRO-3 swaps to NVMe is read in once."""
    weights = torch.zeros(2, dtype=torch.float64)
    for param in _unique(engine.module.parameters()):
        local = getattr(param, "ds_tensor", None)
        if local is None:
            weights += _sums(param)
            continue
        numel = local.numel()
        if numel == 0 and param.ds_numel > 0:
            return None
        _, count = _real_span(param, numel, engine.optimizer._get_param_partition_group(param))
        weights += _sums(local.reshape(-1).narrow(0, 0, count))
    optimizer = torch.zeros(2 + 2 * len(MOMENT_KEYS), dtype=torch.float64)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    swapped = {id(flats[i]): i for i in swapped_sub_groups(engine)}
    for _, tensor in _stepped_tensors(engine):
        with resident_sub_group(engine, swapped.get(id(tensor)), write=False):
            state = _optimizer_state(engine, tensor)
            parts = [_sums(tensor)] + [_sums(state[k]) if k in state else torch.zeros(2, dtype=torch.float64)
                                       for k in MOMENT_KEYS]
            optimizer += torch.cat(parts)
    return {"weights": weights.tolist(), "optimizer": optimizer.tolist()}


def _unique(params: Iterable[torch.nn.Parameter]):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def gather_full_state(engine, with_moments: bool, device: Optional[torch.device] = None
                      ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """Full fp32 weights (and moments) of every unique parameter, by ``named_parameters`` name, on ``device`` (the
    CPU when None); a swapped ZeRO-3 sub-group at a time, each read once."""
    weights, moments = {}, {}
    if with_moments:
        relink_optimizer_state(engine)
    for index, run in by_swapped_sub_group(engine, engine.module.named_parameters()):
        with resident_sub_group(engine, index, write=False):
            for name, param in run:
                weights[name] = full_fp32_param(engine, param, device)
                if with_moments:
                    value = full_moments(engine, param, name, device)
                    if value is not None:
                        moments[name] = value
    return weights, moments


def set_full_fp32_params(engine, values: Mapping[str, torch.Tensor]) -> None:
    """:func:`set_full_fp32_param` for every parameter, from ``values`` by ``named_parameters`` name (each read once,
    in turn), a swapped ZeRO-3 sub-group at a time."""
    for index, run in by_swapped_sub_group(engine, engine.module.named_parameters()):
        with resident_sub_group(engine, index, write=True):
            for name, param in run:
                set_full_fp32_param(engine, param, values[name])


def include_in_gradient_norm(engine, extra_norm: Callable[[], torch.Tensor]) -> Callable[[], Tuple[Any, float]]:
    """Make the global gradient norm of ``engine``'s ZeRO 1/2 or bf16 optimizer include ``extra_norm()`` (the L2
    norm of gradients it does not hold, already reduced over the data-parallel ranks), so that it clips with the
    whole model's norm. Returns a callable giving the norm of the current step once DeepSpeed computed it.

    DeepSpeed 0.19.8: ZeRO 1/2 combine their group norms in ``scaled_global_norm()`` before clipping; the bf16
    optimizer takes the norm of the tensors ``get_grads_for_norm()`` lists, so a one-element tensor holding the
    extra norm adds its square; the stage-0 unfused optimizer (bf16 with a client optimizer) passes its norm to
    ``unscale_and_clip_grads``, after deciding on overflow (its ``overflow_checker``, which an inf or NaN extra norm
    trips too). All keep the result in ``_global_grad_norm`` and skip the step for an inf or NaN extra norm as they
    do for their own (bf16 ZeRO 1/2: when ``bf16.check_grad_overflow``). The returned callable gives
    ``(norm, loss_scale)``: the unfused optimizer scales the loss (dynamic loss scaling, kept for bf16 too), and
    its norm and the gradients it leaves are both scaled; ZeRO 1/2 and the bf16 optimizer report scale 1.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "scaled_global_norm"):
        original = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type=2):
            norm = original(norm_type)
            return combine_grad_norm_groups([norm, extra_norm().to(norm.device)], norm_type=norm_type)

        optimizer.scaled_global_norm = scaled_global_norm
        return lambda: (optimizer._global_grad_norm, optimizer.loss_scale)
    if hasattr(optimizer, "get_grads_for_norm") and hasattr(optimizer, "bf16_groups"):
        original = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping=False):
            grads = original(for_clipping=for_clipping)
            if for_clipping:
                return grads
            dense, experts = grads
            device = dense[0].device if dense else torch.device("cpu")
            return dense + [extra_norm().to(device).reshape(1)], experts

        optimizer.get_grads_for_norm = get_grads_for_norm
        return lambda: (optimizer._global_grad_norm, 1.0)
    if hasattr(optimizer, "unscale_and_clip_grads") and hasattr(optimizer, "fp32_groups"):
        # stage-0 unfused optimizer (bf16 with a client optimizer): it decides on overflow (``overflow_checker``)
        # before it takes the norm, so the extra norm, taken once per step, joins that decision first
        checker, original_check = optimizer.overflow_checker, optimizer.overflow_checker.check
        original = optimizer.unscale_and_clip_grads
        extra = {}

        def check(*args, **kwargs):
            extra["norm"] = float(extra_norm())
            return original_check(*args, **kwargs) or not math.isfinite(extra["norm"])

        def unscale_and_clip_grads(total_norm, apply_scale=True):
            norm = extra.pop("norm") if "norm" in extra else float(extra_norm())
            total_norm = float(torch.tensor([total_norm, norm]).norm())
            optimizer._global_grad_norm = total_norm
            return original(total_norm, apply_scale)

        checker.check = check
        optimizer.unscale_and_clip_grads = unscale_and_clip_grads
        return lambda: (optimizer._global_grad_norm, optimizer.loss_scale_config.cur_scale)
    raise TypeError(f"granular_offload: cannot fold gradients into the global norm of {type(optimizer).__name__} "
                    f"(written against DeepSpeed 0.19.8's ZeRO 1/2, bf16 and stage-0 unfused optimizers)")


def drop_gradients_with(engine, drop: Callable[[], None]) -> None:
    """Make the ``zero_grad`` of ``engine``'s ZeRO 1/2, bf16 or unfused optimizer call ``drop()`` too, for gradients it
    does not hold. DeepSpeed 0.19.8 calls it after every optimizer step, a skipped one (inf or NaN gradients)
    included (``engine._take_model_step``), and ZeRO 1/2 and the unfused optimizer within a skipped step; a client
    optimizer the engine uses as it is (fp32 ZeRO 0) has its own ``zero_grad``."""
    optimizer = engine.optimizer
    if optimizer is basic_optimizer(engine):
        return
    original = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        original(*args, **kwargs)
        drop()

    optimizer.zero_grad = zero_grad


def warn_on_failed_monitor_writes(engine, warn: Callable[[str], None]) -> None:
    """Make the engine's monitor (DeepSpeed's ``MonitorMaster``: its TensorBoard, CSV, W&B and Comet writers, which
    ``engine.step`` writes through too) treat a write that fails with an OSError (a full disk) as a save that fails
    is treated: ``warn`` the first time, and training goes on; the events of that call are lost. Wraps the write of
    that monitor instance, once (the controller hands one monitor from engine to engine)."""
    monitor = engine.monitor
    if hasattr(monitor.write_events, "__wrapped__"):
        return
    write = monitor.write_events
    warned = []

    @functools.wraps(write)
    def write_events(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except OSError as error:
            if not warned:
                warned.append(error)
                warn(f"could not write DeepSpeed's monitors' events: {error}; training goes on without them (later "
                     f"events are written once there is room; this warning is not repeated)")

    monitor.write_events = write_events


def before_gradient_reduction(engine, prepare: Callable[[], None]) -> None:
    """Make ``engine`` call ``prepare()`` before it all-reduces the gradients of a backward itself (DeepSpeed 0.19.8
    ``allreduce_gradients``, after every backward; at ZeRO 0 it reduces every parameter's gradient)."""
    original = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        prepare()
        return original(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients


def steps_when_built(engine) -> bool:
    """True when the engine's optimizer stepped its client optimizer once with zero gradients while it was built
    (DeepSpeed 0.19.8's stage-0 unfused optimizer: ``initialize_optimizer_states``)."""
    optimizer = engine.optimizer
    return hasattr(optimizer, "initialize_optimizer_states") and hasattr(optimizer, "fp32_groups") \
        and not hasattr(optimizer, "bf16_groups")


def data_parallel_group():
    """The process group DeepSpeed averages dense gradients over: the mpu's data-parallel group when the engine was
    given one, else a copy of the world (DeepSpeed 0.19.8 ``groups._get_data_parallel_group``)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


# One staging buffer when a host tensor is broadcast through the device: NCCL takes device tensors only, and a
# whole host_params layer on the device at once is what the offload plan avoids.
HOST_BROADCAST_CHUNK_BYTES = 64 << 20
_UNROUTED: Dict[str, Callable] = {}  # DeepSpeed's own methods while route_host_broadcasts is in place


def broadcast_through_device(broadcast: Callable, tensor: torch.Tensor, src: int, group=None, async_op=False,
                             **kwargs):
    """``broadcast(tensor, src, group)`` (deepspeed.comm's), except that a host tensor under the NCCL backend goes
    through a staging buffer on the accelerator's device, :data:`HOST_BROADCAST_CHUNK_BYTES` at a time; that route is
    synchronous whatever ``async_op`` says (returns None). A backend serving host tensors itself
    (``cpu:gloo,cuda:nccl``, gloo) gets the tensor as it is."""
    if tensor.device.type != "cpu" or str(torch.distributed.get_backend(group)) != "nccl":
        return broadcast(tensor, src, group=group, async_op=async_op, **kwargs)
    from deepspeed.accelerator import get_accelerator

    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    step = max(1, HOST_BROADCAST_CHUNK_BYTES // flat.element_size())
    staging = torch.empty(min(step, flat.numel()), dtype=flat.dtype, device=get_accelerator().current_device_name())
    receives = torch.distributed.get_rank() != src
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step]
        buffer = staging[:piece.numel()]
        buffer.copy_(piece)
        broadcast(buffer, src, group=group, **kwargs)
        if receives:
            piece.copy_(buffer)
    if receives and work is not tensor:
        tensor.copy_(work)
    return None


def _broadcast_model_through_device(engine) -> None:
    """DeepSpeed's ``_broadcast_model`` with its ``deepspeed.comm.broadcast`` calls routed by
    :func:`broadcast_through_device` (DeepSpeed 0.19.8 engine.py calls it as ``dist.broadcast``, ``dist`` being
    ``deepspeed.comm``)."""
    from deepspeed import comm

    plain = comm.broadcast
    comm.broadcast = functools.partial(broadcast_through_device, plain)
    try:
        _UNROUTED["_broadcast_model"](engine)
    finally:
        comm.broadcast = plain


def route_host_broadcasts() -> None:
    """Make ``DeepSpeedEngine._broadcast_model`` (rank 0's model to the others, at initialize) send host tensors
    through the device when the backend is NCCL, which refuses them. Idempotent; nothing changes for device
    tensors or other backends. Raises RuntimeError naming the method when this DeepSpeed has none."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if "_broadcast_model" in _UNROUTED:
        return
    _check_places("granular_offload host_params", {"DeepSpeedEngine": DeepSpeedEngine})
    _UNROUTED["_broadcast_model"] = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = _broadcast_model_through_device


def unroute_host_broadcasts() -> None:
    """Put DeepSpeed's own ``_broadcast_model`` back (undoes :func:`route_host_broadcasts`)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if "_broadcast_model" in _UNROUTED:
        DeepSpeedEngine._broadcast_model = _UNROUTED.pop("_broadcast_model")


def expert_data_parallel_group(name: str):
    """The process group DeepSpeed averages the gradients of expert group ``name`` over."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_group(name)


def total_parameter_numel(model: torch.nn.Module) -> int:
    """The model's distinct parameter elements over every rank (collective; ZeRO-3 partitioned parameters at their
    full size): what each rank holds alike counted once, and the experts of DeepSpeed 0.19.8's MoE layers (marked
    ``allreduce = False``, each rank holding those of its expert-parallel rank) summed over the ranks and divided by
    the ranks that hold the same ones (their expert-data-parallel group)."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    from .checkpoint import gather

    dense, experts = 0, {}
    for param in model.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        if is_moe_param(param):
            experts[param.group_name] = experts.get(param.group_name, 0) + numel
        else:
            dense += numel
    if not experts or not dist.is_initialized():
        return dense + sum(experts.values())
    per_rank = gather(experts)
    return dense + sum(sum(held[name] for held in per_rank) // dist.get_world_size(expert_data_parallel_group(name))
                       for name in experts)


@contextlib.contextmanager
def checksummed_writes(engine, folder: str) -> Iterator[Dict[str, Dict[str, Any]]]:
    """While DeepSpeed saves into ``folder``: its torch checkpoint engine writes each file through a checksumming,
    fsynced file object; yields {path relative to ``folder``: manifest entry} of this rank's files. A failed write
    raises the file system's OSError with the path. Other checkpoint engines write as they do (their files are
    checksummed when the checkpoint is published). The engine's ``save`` is shadowed on the instance for the
    duration only (DeepSpeed 0.19.8: every checkpoint file goes through ``engine.checkpoint_engine.save``)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from .checkpoint import save_with_checksum

    checkpoint_engine = engine.checkpoint_engine
    written: Dict[str, Dict[str, Any]] = {}
    if type(checkpoint_engine) is not TorchCheckpointEngine:
        yield written
        return

    def save(state_dict, path: str) -> None:
        zipfile = checkpoint_engine.zipfile_serialization
        written[os.path.relpath(path, folder)] = save_with_checksum(
            lambda handle: torch.save(state_dict, handle, _use_new_zipfile_serialization=zipfile), path
        )

    checkpoint_engine.save = save
    try:
        yield written
    finally:
        del checkpoint_engine.save


_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                      "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks")


def retire_module(module: torch.nn.Module, message: str) -> None:
    """Cut every link from a module its engine no longer trains back to that engine, and make using it an error.

    DeepSpeed 0.19.8 leaves closures over the engine in the module's forward hooks, ZeRO-3 its partitioning
    attributes and hooks on every submodule and parameter, ZeRO 1/2 and bf16 ``_hp_mapping`` links into their flat
    buffers: a caller that keeps the module would keep the whole engine and its optimizer alive. Every hook goes,
    every attribute DeepSpeed added to a parameter goes, parameter storage is released, and a forward raises
    ``RuntimeError(message)``.
    """
    for sub in module.modules():
        for name in _MODULE_HOOK_DICTS:
            hooks = getattr(sub, name, None)
            if hooks is not None:
                hooks.clear()
        for name in [k for k in vars(sub) if k.startswith(("ds_", "_ds", "__ds"))]:
            delattr(sub, name)
        for param in sub._parameters.values():
            if param is None:
                continue
            param.__dict__.clear()  # ds_tensor, ds_id, all_gather/partition closures, _hp_mapping, hook dicts
            param.grad = None
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def dead(*_args, **_kwargs):
        raise RuntimeError(message)

    module.register_forward_pre_hook(dead)


# DeepSpeed 0.19.8's monitor sections (deepspeed/monitor/config.py, get_monitor_config), each {"enabled": ...}.
MONITOR_SECTIONS = ("tensorboard", "csv_monitor", "wandb", "comet")


def without_monitors(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """``ds_config`` with every monitor section disabled: for an engine that is given the run's monitor after it is
    built (DeepSpeed 0.19.8 builds a ``MonitorMaster`` in every engine, and its TensorBoard monitor opens a new
    event file at once, which would stay empty)."""
    return {key: {**value, "enabled": False} if key in MONITOR_SECTIONS and isinstance(value, dict) else value
            for key, value in ds_config.items()}


def _monitor_places(monitor) -> Dict[str, Any]:
    places = {"MonitorMaster": monitor}
    for name, attribute in (("TensorBoardMonitor", "tb_monitor"), ("csvMonitor", "csv_monitor")):
        if getattr(monitor, attribute, None) is not None:
            places[name] = getattr(monitor, attribute)
    return places


def rewind_monitors(engine) -> None:
    """Make what DeepSpeed's TensorBoard and CSV monitors wrote read as if the run had stopped at the engine's
    current step (its ``global_samples``: DeepSpeed 0.19.8 writes its ``Train/Samples/*`` events against it), so that
    the events a resumed run writes next replace what an interrupted run wrote after its checkpoint.

    TensorBoard: DeepSpeed's ``TensorBoardMonitor`` builds its ``SummaryWriter`` at initialize, before the step a run
    resumes from is known, and without ``purge_step``; its writer gets what ``SummaryWriter(purge_step=samples + 1)``
    writes first, a ``SessionLog.START`` event at that step, on which TensorBoard drops every event of the earlier
    files at or after it. CSV: every file of ``csvMonitor.log_dir`` is rewound to its rows up to ``samples``
    (:func:`~ds_pseudo_real.report.rewind_csv`, the rows dropped kept in ``<file>.discarded``), and noted as having
    its header (``csvMonitor.filenames``), which it otherwise writes again the first time a process writes a file.
    W&B and Comet keep their history on their servers and are left as they are."""
    monitor = engine.monitor
    _check_places("monitors", {"DeepSpeedEngine": engine, **_monitor_places(monitor)})
    samples = engine.global_samples
    writer = getattr(monitor.tb_monitor, "summary_writer", None)
    if writer is not None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # as torch's SummaryWriter writes them

        writer.file_writer.add_event(Event(step=samples + 1, session_log=SessionLog(status=SessionLog.START)))
        writer.flush()
    csv = monitor.csv_monitor
    if csv is not None and csv.enabled and csv.log_dir:
        from pathlib import Path

        from .report import rewind_csv

        for path in sorted(Path(csv.log_dir).glob("*.csv")):
            if rewind_csv(path, samples) and path.stem not in csv.filenames:
                csv.filenames.append(path.stem)
