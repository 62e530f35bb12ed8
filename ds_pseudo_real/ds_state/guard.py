"""The DeepSpeed and torch releases the plugin supports, and the one table of DeepSpeed internals each feature uses.
Checks those internals exist on an engine as it is built; reads no state and wraps nothing (DeepSpeed 0.19.8)."""
from __future__ import annotations

from typing import Any, Dict

import torch


# The releases the package's uses of DeepSpeed and torch internals were written and tested against: [low, high).
SUPPORTED_VERSIONS = {"deepspeed": ("0.19.0", "0.20.0"), "torch": ("2.4.0", "2.15.0")}
# The DeepSpeed internals each feature of the plugin reads or wraps (DeepSpeed 0.19.8), by where they live: the
# engine, a module, the checkpoint engine it saves through, the CPU Adam object whose kernel granular offload calls,
# and under "engine.optimizer" the class of ``engine.optimizer`` (matched by name along its MRO), where
# "parameters.<name>" is an attribute the model's parameters get under that optimizer. An engine whose optimizer is
# none of a feature's classes is refused: the plugin does not know where it keeps its state. Checked when the engine
# is built by :func:`check_internals` (:func:`check_cpu_adam` for the CPU Adam object). Each feature says which
# modules use its entries: this package's by file name, the plugin's others by package path.
OPTIMIZER_AS_GIVEN = "the torch optimizer as given"  # ZeRO 0 in fp32: the engine steps the optimizer it was given
_FLAT_FRAGMENTS = ("_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked", "parameters._hp_mapping")
DEEPSPEED_INTERNALS: Dict[str, Dict[str, Any]] = {
    # full weights and moments read and written at a transition, the byte report, the counters, the loss scaler;
    # used by weights, moments, layout, zero3, loss_scale, nvme_checkpoint (a load under NVMe), accounting,
    # process_groups and ds_pseudo_real.controller (the counters, whether a step was applied, the monitor, destroy)
    "pseudo_to_real": {
        "DeepSpeedEngine": ("global_steps", "global_samples", "micro_steps", "skipped_steps", "monitor",
                            "get_data_types", "destroy", "was_step_applied",
                            "_get_zero_ckpt_name", "use_node_local_storage", "local_rank", "global_rank"),
        "deepspeed.utils.groups": ("_get_expert_data_parallel_group",),  # the report's parameters over all ranks
        "FusedAdam": ("multi_tensor_adam", "_dummy_overflow_buf", "adam_w_mode"),  # its CPU kernel replayed
        "engine.optimizer": {
            "DeepSpeedZeroOptimizer": _FLAT_FRAGMENTS + ("loss_scaler.cur_scale",),
            "BF16_Optimizer": _FLAT_FRAGMENTS,
            "DeepSpeedZeroOptimizer_Stage3": ("fp32_partitioned_groups_flat", "sub_group_to_group_id",
                                              "loss_scaler.cur_scale", "grad_position", "get_param_id", "swap_optimizer",
                                              "_swappable_optimizer_subgroup",  # NVMe: one sub-group at a time
                                              "_optimizer_states_and_gradient_swap_in",
                                              "_optimizer_states_and_gradient_swap_out", "_release_swap_buffers",
                                              "_get_param_partition_group",
                                              # a load under NVMe: the sub-groups' masters and moments restored
                                              "fp16_partitioned_groups_flat_numel",
                                              "_reassign_or_swap_out_partitioned_parameters",
                                              "checkpoint_event_prologue", "checkpoint_event_epilogue",
                                              "parameters.ds_id", "parameters.ds_tensor", "parameters.ds_numel"),
            "FP16_UnfusedOptimizer": ("fp16_groups", "fp32_groups", "loss_scale_config.cur_scale"),
            OPTIMIZER_AS_GIVEN: (),
        },
    },
    "save_checkpoint": {  # every file checksummed as DeepSpeed writes it; used by checkpoint_integrity
        "DeepSpeedEngine": ("checkpoint_engine",),
        "TorchCheckpointEngine": ("save", "zipfile_serialization"),
    },
    # its own groups (host_params outside DeepSpeed's optimizer): norm, overflow, zero_grad, the groups; used by
    # engine_hooks, process_groups, moments (the CPU Adam kernel), ds_pseudo_real.offload (the dtype, the CPU Adam
    # kernel)
    "granular_offload": {
        "DeepSpeedEngine": ("communication_data_type", "mpu"),
        "deepspeed.utils.groups": ("_get_data_parallel_group", "_get_expert_data_parallel_group"),
        "deepspeed.utils.bwc": ("bwc_tensor_model_parallel_rank",),
        "deepspeed.runtime.utils": ("is_model_parallel_parameter",),
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
    # a PipelineModule's stages rebuilt with their layers tied or untied, the data iterator carried to the next
    # engine; used by pipeline and ds_pseudo_real.pipeline
    "pipeline": {
        "PipelineModule": ("_layer_specs", "parts", "stage_id", "_set_bounds", "_partition_layers", "_topo",
                           "loss_fn", "seed_layers", "seed_fn", "base_seed", "activation_checkpoint_interval",
                           "activation_checkpoint_func", "checkpointable_layers", "dynamic_shape",
                           "_synchronize_tied_weights", "tied_comms", "global_rank", "mpu", "_local_start",
                           "_local_stop", "tied_modules"),
        "PipelineEngine": ("data_iterator", "set_dataiterator", "train_batch"),
    },
    # a ZeRO-3 checkpoint with the optimizer state on NVMe: the swapped fp32 partitions filled in; used by
    # nvme_checkpoint
    "convert": {
        "deepspeed.utils.zero_to_fp32": ("parse_model_states", "get_model_state_files", "parse_optim_states",
                                         "get_optim_files", "_get_fp32_state_dict_from_zero3_checkpoint",
                                         "to_torch_tensor"),
    },
    # the model broadcast at initialize, through the device under NCCL; ZeRO 0's all-reduce, given device gradients;
    # used by host_broadcast, engine_hooks
    "granular_offload host_params": {
        "DeepSpeedEngine": ("_broadcast_model", "allreduce_gradients"),
        "deepspeed.comm": ("broadcast",),
    },
    # one writer per run across engines, rewound to the step a run resumes from (rank 0's monitor); a failed write
    # (a full disk) is a warning, not an exception out of engine.step; used by monitors
    "monitors": {
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


def check_places(feature: str, places: Dict[str, Any]) -> None:
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
        check_places(feature, places)
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
    check_places(feature, {"DeepSpeedCPUAdam": cpu_adam})
