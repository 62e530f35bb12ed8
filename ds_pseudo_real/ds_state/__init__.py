"""Every use of DeepSpeed's internals by the plugin (written against DeepSpeed 0.19.8), one module per concern:

    guard                 the supported releases, and DEEPSPEED_INTERNALS: the one table of the internals each feature
                          uses, checked on every engine as it is built
    layout                where an engine keeps its torch optimizer, each parameter's fp32 master and its state
    zero3                 ZeRO-3's flat sub-groups: a parameter's partition in them, the sub-groups swapped to NVMe
    moments               Adam's moments and step counters read, seeded and written; the CPU Adam kernel replay
    loss_scale            the fp16 loss scaler's state read and written, from an engine or a saved checkpoint
    weights               full fp32 weights read and written; the whole model's weights and moments gathered
    nvme_checkpoint       the optimizer state a ZeRO-3 checkpoint holds on NVMe, restored after a load and converted
    checkpoint_integrity  checkpoint files checksummed as DeepSpeed writes them (or snapshotted for a writer
                          thread); the state fingerprint of a load
    process_groups        the data-parallel, expert and model-parallel groups DeepSpeed reduces gradients over
    pipeline              a PipelineModule's specs and stage's layers read, a module like it built, tied weights synced
    accounting            the bytes a rank holds, the parameters over all ranks
    engine_hooks          granular offload's gradients in the engine's norm, overflow check, zero_grad and reduction
    host_broadcast        a class-level patch: the model broadcast sends host tensors through the device
    op_builds             two patches: every C++ op build said (what, once, where), a stale build lock named, and
                          the main job's backend made without the op only DeepSpeed's inference uses
    monitors              one monitor per run, rewound on resume, a failed write a warning
    retire                a module its engine no longer trains, cut loose from that engine

Each module imports only modules above it in this list. The names used outside the package are re-exported
below (``ds_state.full_moments``). A replacement (a test's monkeypatch) goes where the name is looked up: in the
module that defines it, or in the one that imported it (``ds_state.weights.full_moments`` is what
``gather_full_state`` calls). Setting a constant here changes nothing: set it on its module
(``ds_state.host_broadcast.HOST_BROADCAST_CHUNK_BYTES``).
"""
from __future__ import annotations

from .guard import DEEPSPEED_INTERNALS, SUPPORTED_VERSIONS, check_cpu_adam, check_internals, check_versions
from .layout import basic_optimizer, optimizer_state, stepped_tensors
from .zero3 import held_in_memory, swapped_sub_groups
from .moments import (
    MOMENT_KEYS, UnwrittenMoments, full_moments, replay_cpu_adam_steps, replay_kernel_steps, seed_optimizer_state,
    set_full_moments_of_copies, step_counters, unfilled, write_swapped_moments,
)
from .loss_scale import (
    current_loss_scale, loss_scaler_state, may_skip_steps, saved_loss_scaler_state, set_loss_scaler_state,
)
from .weights import full_fp32_param, gather_full_state, set_full_fp32_params
from .nvme_checkpoint import (
    regather_persistent_parameters, restore_swapped_optimizer_state, swapped_state_files,
    zero3_fp32_weights_with_swapped_masters,
)
from .checkpoint_integrity import checksummed_writes, fingerprint_of, fingerprint_terms, state_fingerprint
from .process_groups import data_parallel_group, expert_data_parallel_group, model_parallel, splits_over_tensor_parallel
from .pipeline import is_pipeline_module, pipeline_stage_layers, tied_across_stages
from .accounting import memory_report, total_parameter_numel
from .engine_hooks import before_gradient_reduction, drop_gradients_with, include_in_gradient_norm, steps_when_built
from .host_broadcast import HOST_BROADCAST_CHUNK_BYTES, route_host_broadcasts, unroute_host_broadcasts
from .op_builds import StaleBuildLock, announce_op_builds, skip_inference_all_reduce_op
from .monitors import MONITOR_SECTIONS, rewind_monitors, warn_on_failed_monitor_writes, without_monitors
from .retire import retire_module
