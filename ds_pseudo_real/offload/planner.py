"""Granular offload placement: per-group byte accounting and the planner, as plain functions over plain data.

Owns: the placement levels, the per-rank byte model of one parameter group under DeepSpeed ZeRO 0/1/2, and
choosing a level per group that fits a device-memory budget while moving the fewest bytes per step.
Must not import torch, DeepSpeed or Megatron: the CLI plans M6-10T-sized models from a config without building them.

Byte model (per rank, written against DeepSpeed 0.19.8 ``stage_1_and_2.py`` / ``bf16_optimizer.py``):
  n = the group's parameter elements; w = working dtype bytes (4 fp32, 2 bf16 or fp16: fp16 keeps what bf16 keeps,
      its loss scaler's overflow check reduces each gradient to two scalars); D = data-parallel size;
  m = the optimizer's partition of the group: n under ZeRO 0 (in fp32 the optimizer steps the model's params; in
      bf16 DeepSpeed's stage-0 unfused optimizer keeps a full fp32 copy of each), else ceil(n / 2D) * 2 (DeepSpeed
      pads each flat group to a multiple of 2 * D, then splits it D ways).
  DeepSpeed-owned, every level: working params n*w (on the host for HOST_PARAMS), gradients n*w (m*w under ZeRO 2),
      and under ZeRO >= 1 or in 16 bits its own fp32 partition 4*m on the device.
  Optimizer-owned (what GranularOffloadOptimizer holds): Adam moments 8*m, on the device for DEVICE; for the host
      levels the moments, a host fp32 master 4*m and a host gradient buffer 4*m on the host (for HOST_PARAMS in
      fp32 ZeRO 0 the host params are that master, so they are not counted twice).
  Moved per optimizer step, of GA = ``gradient_accumulation_steps`` micro-batches: HOST_OPTIMIZER gradient D2H
      4*m + updated master H2D 4*m, once (DeepSpeed accumulates the gradients on the device); HOST_PARAMS params H2D
      twice per micro-batch (forward and backward fetch) 2*GA*n*w per layer using them, with a device buffer for
      two layers' params (the fetched one and the prefetched next), and gradient D2H 4*n, GA times where they are
      streamed (ZeRO 1/2 outside DeepSpeed, below), else once (accumulated on the device until the step).
  HOST_PARAMS where DeepSpeed keeps its own copies (ZeRO 1/2, bf16, fp16): the group is left out of DeepSpeed's
      optimizer (its flat buffers would pin the params to the device). Under ZeRO 1/2 the offload optimizer reduces
      its gradients itself, streaming each to the host as soon as it is accumulated: nothing of it stays on the
      device but the prefetch buffer and the gradients of one layer in flight; later micro-batches add theirs
      into the host buffer. At stage 0 (bf16) the engine
      all-reduces them, so the gradients n*w stay on the device until the step. The host holds params n*w, a
      separate fp32 master 4*n when w != 4, a gradient buffer 4*n and moments 8*n (not partitioned). The host step
      one step late (``host_step: "delayed"``, where the gradients are streamed) adds a second gradient buffer 4*n
      and, in fp32, a master 4*n apart from the host params.
  Backups of the host step during the backward (``host_step: "overlapped"``, where the gradients are streamed):
      where a step may be refused (gradient clipping on, fp16, or bf16 with DeepSpeed's ``check_grad_overflow``),
      the optimizer keeps a copy of what it steps ahead: fp32 master and moments 12*n, and the 16-bit host params
      2*n, on the host (pageable: not registered with the device).

Besides the groups, per rank (``TrainingSetup`` carries the figures; ``config.training_setup`` fills them from the
DeepSpeed config for the accelerator the run is on):
  Device, all the time: ``reserved`` (CUDA context, NCCL and cuBLAS buffers, fragmentation; the config's default
      is ``DEFAULT_RESERVED_BYTES`` on CUDA) and one allocator pool per side stream of the offload
      (``stream_pool_bytes`` each: the host optimizer's copies when a group is off the device, the fetches when
      one is at HOST_PARAMS).
  Device, during the backward: activations, the prefetch buffer, the streamed gradients and DeepSpeed's reduce
      bucket (ZeRO 1/2: ``reduce_bucket_size`` elements of the gradient dtype, twice with ``overlap_comm``;
      ``stage_1_and_2.py`` ``setup_buckets`` allocates it whatever the model's size). No all-gather bucket: ZeRO
      1/2 and the bf16 optimizer gather into their flat buffers with ``all_gather_into_tensor``
      (``runtime/utils.py`` ``all_gather_dp_groups``) whenever torch has it, which every accepted torch does.
      Under ZeRO 2 with GA > 1, from the second micro-batch on, the gradient partition accumulated so far (m*w per
      DeepSpeed group: ``all_grad_tensors``) besides the fresh ``grads_in_partition`` the backward fills. ZeRO 1
      and stage 0 accumulate into the full gradients n*w, counted with the groups.
  Device, during the step (after the backward freed the above): ZeRO 1/2 flatten each DeepSpeed group's gradient
      partition (m*w) and cast it to fp32 (4*m more when w != 4), one group at a time: the largest group's.
  Host: each kind of buffer above (params, master, gradient buffer, each moment) is one flat allocation per
      group; pinned ones (CUDA, ``pin_memory``) are anonymous pages registered with the CUDA runtime at their exact
      size (``ds_pseudo_real.pinned``), so each takes whole pages of ``PAGE_BYTES``: ``host_allocated_bytes`` is what the
      host gives, and it is what ``host_memory`` bounds. (torch's own pinned allocator, not used for them, rounds
      every allocation up to a power of two: +31 % for an M6-10T expert group.)
Modelled time the offload adds to an optimizer step (no overlap assumed: an upper bound): the bytes moved per
optimizer step over PCIe at ``pcie_bytes_per_s`` plus the host Adam, once per optimizer step whatever GA, over the
elements the host steps at ``cpu_adam_params_per_s``.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

ADAM_STATES = 2  # exp_avg, exp_avg_sq
FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OTHER = "other"  # name of the group holding every parameter outside the layer list
EXPERTS = ".experts"  # suffix of a layer's MoE expert group: "layer3.experts"

# Defaults of the figures the byte model cannot read from a config (per rank), each overridable.
# Kept free on a CUDA device (granular_offload.reserved): the CUDA context and its kernels (0.3 to 0.6 GiB, outside
# PyTorch's allocator), NCCL communicator buffers, cuBLAS workspaces and the caching allocator's fragmentation.
DEFAULT_RESERVED_BYTES = 2**30
# The page size of the hosts (x86-64 Linux): a pinned host buffer is registered in whole pages.
PAGE_BYTES = 4096
# Per side stream: PyTorch's CUDA caching allocator reuses a freed block only on the stream it was allocated on, so
# each stream holds at least one small-pool segment (kSmallBuffer, 2 MiB) and one large-pool segment (kLargeBuffer,
# 20 MiB) of its own (torch 2.13 c10/core/AllocatorConfig.h, c10/cuda/CUDACachingAllocator.cpp).
STREAM_POOL_BYTES = 22 * 2**20
# granular_offload.pcie_gb_per_s: pinned host<->device copies on PCIe 3.0 x16 (15.75 GB/s raw, ~12 GB/s measured),
# the V100 nodes M6-10T trained on; PCIe 4.0 doubles it, two GPUs behind one switch halve it.
DEFAULT_PCIE_BYTES_PER_S = 12e9
# granular_offload.cpu_adam_params_per_s: DeepSpeedCPUAdam is bound by memory bandwidth (~28 B read and written per
# fp32 parameter: param, gradient, two moments); eight ranks sharing a two-socket node's ~150 GB/s get ~0.5e9 each
# (one core of an AMD EPYC VM stepped 0.75e9 params/s on a 20M-parameter step, DeepSpeed 0.19.8).
DEFAULT_CPU_ADAM_PARAMS_PER_S = 5e8


class PlacementLevel(str, Enum):
    DEVICE = "device"
    HOST_OPTIMIZER = "host_optimizer"
    HOST_PARAMS = "host_params"


LEVEL_ORDER = [PlacementLevel.DEVICE, PlacementLevel.HOST_OPTIMIZER, PlacementLevel.HOST_PARAMS]


class PlanError(ValueError):
    """No placement fits, or the requested placement is not supported with this setup. When nothing fits the
    budget, ``plan`` is the furthest placement tried (every group at its furthest allowed level)."""

    def __init__(self, message: str, plan: Optional["OffloadPlan"] = None):
        super().__init__(message)
        self.plan = plan


class HostMemoryError(PlanError):
    """The placement needs more host memory per rank than ``host_memory`` gives (``plan``: that placement)."""


@dataclass(frozen=True)
class GroupSize:
    """One placeable parameter group: a layer (``index`` >= 0), a layer's MoE experts, or the non-layer rest
    (``index`` = -1). ``uses``: how many layers run with these parameters (L / groups in a pseudo model, else 1).
    ``dp_size``: ranks ZeRO partitions this group over when not the run's data-parallel size (experts spread over
    expert-parallel ranks are replicated only world / expert_parallel times)."""

    name: str
    numel: int
    index: int = -1
    uses: int = 1
    dp_size: Optional[int] = None

    @property
    def is_layer(self) -> bool:
        return self.index >= 0

    @property
    def is_experts(self) -> bool:
        return self.name.endswith(EXPERTS)

    @property
    def fetchable(self) -> bool:
        """Can live at HOST_PARAMS: the fetch hooks are the layers' (a layer's experts are fetched with it)."""
        return self.is_layer


@dataclass(frozen=True)
class TrainingSetup:
    """What the byte model needs to know about the run, per data-parallel rank."""

    dtype: str = "fp32"
    zero_stage: int = 0
    dp_size: int = 1
    activation_bytes: int = 0
    reserved_bytes: int = 0
    reduce_bucket_bytes: int = 0  # DeepSpeed's gradient reduce bucket(s), during the backward
    stream_pool_bytes: int = 0  # per side stream of the offload
    pinned_host: bool = False  # host buffers pinned: each in whole pages (``pinned_bytes``)
    pageable_copies: bool = False  # CUDA with pin_memory false: every host<->device copy is synchronous
    host_memory_bytes: Optional[int] = None  # refuse placements needing more host memory per rank
    pcie_bytes_per_s: float = DEFAULT_PCIE_BYTES_PER_S
    cpu_adam_params_per_s: float = DEFAULT_CPU_ADAM_PARAMS_PER_S
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    host_step: str = "sequential"  # granular_offload.host_step
    host_step_backups: bool = False  # host_step "overlapped" where a step may be refused: copies of what it steps

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype: got {self.dtype!r}, accepted: {sorted(DTYPE_BYTES)}")
        if self.zero_stage not in (0, 1, 2):
            raise PlanError(f"zero_optimization.stage: got {self.zero_stage!r}, granular offload accepts 0, 1, 2")
        if self.dp_size < 1:
            raise PlanError(f"world size / data-parallel size: got {self.dp_size!r}, accepted: an integer >= 1")
        if self.gradient_accumulation_steps < 1:
            raise PlanError(f"gradient_accumulation_steps: got {self.gradient_accumulation_steps!r}, accepted: an "
                            f"integer >= 1")
        for name, rate in (("pcie_gb_per_s", self.pcie_bytes_per_s / 1e9),
                           ("cpu_adam_params_per_s", self.cpu_adam_params_per_s)):
            if not rate > 0:
                raise PlanError(f"granular_offload.{name}: got {rate!r}, accepted: a number > 0")

    @property
    def working_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def has_separate_master(self) -> bool:
        """DeepSpeed keeps its own flat fp32 partition (ZeRO 1/2, or the 16-bit optimizer at stage 0)."""
        return self.zero_stage >= 1 or self.dtype != "fp32"

    @property
    def host_params_outside_deepspeed(self) -> bool:
        """HOST_PARAMS groups are stepped and reduced by the offload optimizer, outside DeepSpeed's flat groups."""
        return self.has_separate_master

    @property
    def streams_gradients(self) -> bool:
        """HOST_PARAMS gradients leave the device as soon as they are accumulated (ZeRO 1/2; at stage 0 the engine
        all-reduces every gradient of the model after the backward, so they stay there until the step)."""
        return self.host_params_outside_deepspeed and self.zero_stage >= 1


class GroupBytes(NamedTuple):
    """Per-rank bytes of one group at one level (``moved_per_step``: per optimizer step)."""

    device: int
    host: int
    moved_per_step: int
    optimizer_device: int
    optimizer_host: int


def partition_numel(numel: int, setup: TrainingSetup, dp_size: Optional[int] = None) -> int:
    """Elements of the flat fp32 partition the optimizer steps on this rank (DeepSpeed's padding rule)."""
    if setup.zero_stage == 0:
        return numel
    dp = dp_size or setup.dp_size
    alignment = 2 * dp
    return math.ceil(numel / alignment) * alignment // dp


def outside_deepspeed(level: PlacementLevel, setup: TrainingSetup) -> bool:
    """A group at ``level`` is stepped and reduced by the offload optimizer alone, not in DeepSpeed's groups."""
    return PlacementLevel(level) is PlacementLevel.HOST_PARAMS and setup.host_params_outside_deepspeed


def host_buffers(numel: int, level: PlacementLevel, setup: TrainingSetup, dp_size: Optional[int] = None
                 ) -> Tuple[int, ...]:
    """Bytes of each host allocation of one group at ``level``: params (HOST_PARAMS), a separate fp32 master, the
    gradient buffer, the two moments and, for gradients streamed every micro-batch with gradient accumulation, the
    buffer later micro-batches land in before they are added; one flat buffer each."""
    level = PlacementLevel(level)
    w, m = setup.working_bytes, partition_numel(numel, setup, dp_size)
    if level is PlacementLevel.DEVICE:
        return ()
    if level is PlacementLevel.HOST_OPTIMIZER:
        return (FP32 * m,) * (2 + ADAM_STATES)
    if outside_deepspeed(level, setup):
        delayed = setup.host_step == "delayed" and setup.streams_gradients
        separate_master = (FP32 * numel,) if w != FP32 or delayed else ()
        staging = (FP32 * numel,) if setup.streams_gradients and setup.gradient_accumulation_steps > 1 else ()
        spare_gradient = (FP32 * numel,) if delayed else ()
        return (numel * w,) + separate_master + (FP32 * numel,) * (1 + ADAM_STATES) + staging + spare_gradient
    return (numel * w,) + (FP32 * m,) * (1 + ADAM_STATES)  # fp32 ZeRO 0: the host params are the master


def backup_buffers(numel: int, level: PlacementLevel, setup: TrainingSetup) -> Tuple[int, ...]:
    """Bytes of each backup of one group the host step during the backward keeps (``ahead.HostStepAhead``): its fp32
    master, the two moments and, in 16 bits, its host params; none where nothing is stepped ahead or no step can
    be refused."""
    if not (setup.host_step_backups and setup.streams_gradients and outside_deepspeed(level, setup)):
        return ()
    w = setup.working_bytes
    return (FP32 * numel,) * (1 + ADAM_STATES) + ((numel * w,) if w != FP32 else ())


def pinned_bytes(size: int) -> int:
    """Host bytes a pinned buffer of ``size`` takes: the whole pages it is registered in (``ds_pseudo_real.pinned``)."""
    return -(-size // PAGE_BYTES) * PAGE_BYTES


def host_numel_stepped(numel: int, level: PlacementLevel, setup: TrainingSetup, dp_size: Optional[int] = None
                       ) -> int:
    """Elements the host Adam steps for one group at ``level`` (its partition, or all of it outside DeepSpeed)."""
    level = PlacementLevel(level)
    if level is PlacementLevel.DEVICE:
        return 0
    return numel if outside_deepspeed(level, setup) else partition_numel(numel, setup, dp_size)


def group_bytes(numel: int, level: PlacementLevel, setup: TrainingSetup, uses: int = 1,
                dp_size: Optional[int] = None) -> GroupBytes:
    """The byte model of the module docstring for one group at ``level``; ``uses`` multiplies the fetches,
    ``dp_size`` overrides the ranks the group is partitioned over. Host bytes are the tensors' (unrounded)."""
    level = PlacementLevel(level)
    w, m = setup.working_bytes, partition_numel(numel, setup, dp_size)
    ga = setup.gradient_accumulation_steps
    params = numel * w
    fetches = 2 * ga * uses * params  # forward and backward of every micro-batch
    grads = (m if setup.zero_stage == 2 else numel) * w
    ds_master = FP32 * m if setup.has_separate_master else 0
    moments = ADAM_STATES * FP32 * m
    host = sum(host_buffers(numel, level, setup, dp_size)) + sum(backup_buffers(numel, level, setup))
    if level is PlacementLevel.DEVICE:
        return GroupBytes(params + grads + ds_master + moments, 0, 0, moments, 0)
    if level is PlacementLevel.HOST_OPTIMIZER:
        return GroupBytes(params + grads + ds_master, host, 2 * FP32 * m, 0, host)
    if outside_deepspeed(level, setup):
        device, streams = (0, ga) if setup.streams_gradients else (numel * w, 1)
        return GroupBytes(device, host, streams * FP32 * numel + fetches, 0, host)
    return GroupBytes(grads, host, FP32 * numel + fetches, 0, host)


def flat_gradient_bytes(numel: int, setup: TrainingSetup, dp_size: Optional[int] = None) -> int:
    """Device temporaries of DeepSpeed's ZeRO 1/2 step for one of its groups: the flattened gradient partition in
    the working dtype, and its fp32 copy when that dtype is not fp32 (``stage_1_and_2.py`` ``step``)."""
    if setup.zero_stage == 0:
        return 0
    m = partition_numel(numel, setup, dp_size)
    return m * setup.working_bytes + (FP32 * m if setup.working_bytes != FP32 else 0)


def accumulated_gradient_bytes(numel: int, setup: TrainingSetup, dp_size: Optional[int] = None) -> int:
    """Device bytes ZeRO 2 holds besides the group's gradient partition during the backward of a micro-batch after
    the first: the partition accumulated so far, while the backward fills a fresh one (``stage_1_and_2.py``
    ``independent_gradient_partition_epilogue``: ``all_grad_tensors`` beside a new ``grads_in_partition``)."""
    if setup.zero_stage != 2 or setup.gradient_accumulation_steps == 1:
        return 0
    return partition_numel(numel, setup, dp_size) * setup.working_bytes


@dataclass(frozen=True)
class GroupPlacement:
    group: GroupSize
    level: PlacementLevel
    bytes: GroupBytes
    host_buffers: Tuple[int, ...] = ()
    backup_buffers: Tuple[int, ...] = ()  # pageable, also in ``bytes.host``
    flat_gradient_bytes: int = 0  # DeepSpeed's step temporaries for this group (0 outside its groups)
    accumulated_gradient_bytes: int = 0  # DeepSpeed's, during later micro-batches (0 outside its groups)


@functools.lru_cache(maxsize=4096)  # the planner places the same few group sizes thousands of times
def _placement(group: GroupSize, level: PlacementLevel, setup: TrainingSetup) -> GroupPlacement:
    inside = not outside_deepspeed(level, setup)
    return GroupPlacement(
        group, level, group_bytes(group.numel, level, setup, group.uses, group.dp_size),
        host_buffers(group.numel, level, setup, group.dp_size), backup_buffers(group.numel, level, setup),
        flat_gradient_bytes(group.numel, setup, group.dp_size) if inside else 0,
        accumulated_gradient_bytes(group.numel, setup, group.dp_size) if inside else 0)


@dataclass
class OffloadPlan:
    """A level per group and the predicted per-rank bytes (see the module docstring for the byte model)."""

    setup: TrainingSetup
    budget_bytes: Optional[int]
    placements: List[GroupPlacement] = field(default_factory=list)

    def _fetched_layers(self) -> List[int]:
        """Elements fetched per layer that has host_params groups (its dense part and its experts together),
        largest first, listed once per layer a shared set serves (twice at most: the buffer holds two)."""
        per_layer: Dict[int, List[GroupPlacement]] = {}
        for p in self.placements:
            if p.level is PlacementLevel.HOST_PARAMS:
                per_layer.setdefault(p.group.index, []).append(p)
        sizes = []
        for placements in per_layer.values():
            uses = min(max(p.group.uses for p in placements), 2)  # a shared set: two layers' copies
            sizes += [sum(p.group.numel for p in placements)] * uses
        return sorted(sizes, reverse=True)

    @property
    def prefetch_buffer_bytes(self) -> int:
        """Device buffer for host-resident params: the fetched layer and the prefetched next one."""
        return sum(self._fetched_layers()[:2]) * self.setup.working_bytes

    @property
    def streamed_gradient_bytes(self) -> int:
        """Device bytes of host_params gradients streamed to the host (outside DeepSpeed's groups): at most one
        layer's gradients are on the device before their hooks move them."""
        if not self.setup.streams_gradients:
            return 0
        return max(self._fetched_layers(), default=0) * self.setup.working_bytes

    @property
    def side_streams(self) -> int:
        """Side streams the offload allocates on: the host optimizer's copies, the parameter fetches."""
        offloaded = any(p.level is not PlacementLevel.DEVICE for p in self.placements)
        fetched = any(p.level is PlacementLevel.HOST_PARAMS for p in self.placements)
        return int(offloaded) + int(fetched)

    @property
    def stream_pool_bytes(self) -> int:
        return self.side_streams * self.setup.stream_pool_bytes

    @property
    def accumulated_gradient_bytes(self) -> int:
        """Device bytes of the gradient partitions ZeRO 2 has accumulated over the earlier micro-batches of a step."""
        return sum(p.accumulated_gradient_bytes for p in self.placements)

    @property
    def backward_bytes(self) -> int:
        """Device bytes held only during the forward and backward."""
        return (self.setup.activation_bytes + self.prefetch_buffer_bytes + self.streamed_gradient_bytes
                + self.setup.reduce_bucket_bytes + self.accumulated_gradient_bytes)

    @property
    def flat_gradient_bytes(self) -> int:
        """Device temporaries of DeepSpeed's step: the largest of its groups' flattened gradients (ZeRO 1/2)."""
        return max((p.flat_gradient_bytes for p in self.placements), default=0)

    @property
    def device_bytes(self) -> int:
        """Peak per rank: the groups, the stream pools and ``reserved``, plus the larger of the backward's and
        the step's temporaries."""
        return (sum(p.bytes.device for p in self.placements) + self.stream_pool_bytes + self.setup.reserved_bytes
                + max(self.backward_bytes, self.flat_gradient_bytes))

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tensors (what the optimizer holds)."""
        return sum(p.bytes.host for p in self.placements)

    @property
    def host_allocated_bytes(self) -> int:
        """Host memory per rank: ``host_bytes`` with each pinned buffer in whole pages."""
        if not self.setup.pinned_host:
            return self.host_bytes
        return sum(pinned_bytes(size) for p in self.placements for size in p.host_buffers) + self.backup_bytes

    @property
    def backup_bytes(self) -> int:
        """Host bytes of the host step's backups (:func:`backup_buffers`), within ``host_bytes``."""
        return sum(sum(p.backup_buffers) for p in self.placements)

    @property
    def host_stepped_numel(self) -> int:
        """Elements the host Adam steps per optimizer step on this rank (once, whatever the micro-batches)."""
        return sum(host_numel_stepped(p.group.numel, p.level, self.setup, p.group.dp_size) for p in self.placements)

    @property
    def transfer_seconds(self) -> float:
        """Modelled seconds of host<->device copies per optimizer step."""
        return self.moved_bytes_per_step / self.setup.pcie_bytes_per_s

    @property
    def host_adam_seconds(self) -> float:
        """Modelled seconds of the host Adam per optimizer step."""
        return self.host_stepped_numel / self.setup.cpu_adam_params_per_s

    @property
    def offload_seconds_per_step(self) -> float:
        """Modelled time the offload adds to an optimizer step (all its micro-batches): the transfers, then the
        host Adam (no overlap assumed)."""
        return self.transfer_seconds + self.host_adam_seconds

    @property
    def moved_bytes_per_step(self) -> int:
        """Bytes copied between host and device per optimizer step (``gradient_accumulation_steps`` micro-batches)."""
        return sum(p.bytes.moved_per_step for p in self.placements)

    @property
    def optimizer_device_bytes(self) -> int:
        return sum(p.bytes.optimizer_device for p in self.placements)

    @property
    def optimizer_host_bytes(self) -> int:
        return sum(p.bytes.optimizer_host for p in self.placements)

    def level_of(self, name: str) -> PlacementLevel:
        for placement in self.placements:
            if placement.group.name == name:
                return placement.level
        raise KeyError(name)

    def levels(self) -> Dict[str, str]:
        return {p.group.name: p.level.value for p in self.placements}

    def fits(self) -> bool:
        return self.budget_bytes is None or self.device_bytes <= self.budget_bytes

    def fits_host(self) -> bool:
        return self.setup.host_memory_bytes is None or self.host_allocated_bytes <= self.setup.host_memory_bytes


def place(groups: Sequence[GroupSize], levels: Mapping[str, PlacementLevel], setup: TrainingSetup,
          budget_bytes: Optional[int] = None) -> OffloadPlan:
    """The plan for explicitly chosen levels (a group missing from ``levels`` stays on the device)."""
    plan = OffloadPlan(setup, budget_bytes)
    experts = [g for g in groups if g.is_experts]
    if setup.host_params_outside_deepspeed and experts and all(
            PlacementLevel(levels.get(g.name, PlacementLevel.DEVICE)) is PlacementLevel.HOST_PARAMS for g in experts):
        raise PlanError(f"granular_offload.levels: every layer's experts at 'host_params' under ZeRO stage "
                        f"{setup.zero_stage}, {setup.dtype}, where they are stepped outside DeepSpeed's optimizer; "
                        f"DeepSpeed 0.19.8 needs one MoE param group in its own optimizer: put one layer's experts "
                        f"(e.g. '{experts[0].name[len('layer'):]}') at 'device' or 'host_optimizer'")
    for group in groups:
        level = PlacementLevel(levels.get(group.name, PlacementLevel.DEVICE))
        if level is PlacementLevel.HOST_PARAMS and not group.fetchable:
            raise PlanError(f"granular_offload.levels.{group.name}: 'host_params' is for the layers' parameters "
                            f"(fetched by layer hooks), not for parameters outside the layers; accepted for "
                            f"{group.name!r}: 'device', 'host_optimizer'")
        plan.placements.append(_placement(group, level, setup))
    if not plan.fits_host():
        need, limit = plan.host_allocated_bytes, setup.host_memory_bytes
        raise HostMemoryError(
            f"granular_offload.host_memory: the placement needs {format_bytes(need)} ({need} bytes) of host memory "
            f"per rank{_pinned_note(setup)}, above host_memory {format_bytes(limit)} ({limit} bytes); accepted: a "
            f"placement within it: fewer groups off the device (a larger device_memory, or levels nearer the "
            f"device), more data-parallel ranks, a larger host_memory",
            plan,
        )
    return plan


def _pinned_note(setup: TrainingSetup) -> str:
    return " (pinned: each buffer in whole pages)" if setup.pinned_host else ""


def plan_placement(groups: Sequence[GroupSize], setup: TrainingSetup, budget_bytes: int,
                   max_level: PlacementLevel = PlacementLevel.HOST_PARAMS) -> OffloadPlan:
    """Fill the device budget, offloading only what does not fit, and move the fewest bytes doing so.

    Greedy: starting from everything on the device, repeatedly take one group one level further from the device,
    choosing the step that frees the most device bytes per byte it adds to the per-step traffic (ties: the nearer
    level, then the later layer, so the first layers, needed first in the forward, stay resident). Exact when the layers have the
    same size, which is the case this plugin serves. Raises :class:`PlanError` saying how much is missing.
    """
    allowed = LEVEL_ORDER[: LEVEL_ORDER.index(PlacementLevel(max_level)) + 1]
    levels = {g.name: PlacementLevel.DEVICE for g in groups}
    plan = place(groups, levels, setup, budget_bytes)
    while not plan.fits():
        candidates = []
        host_refused: List[HostMemoryError] = []
        for placement in plan.placements:
            order = allowed.index(placement.level)
            if order + 1 >= len(allowed):
                continue
            nxt = allowed[order + 1]
            if nxt is PlacementLevel.HOST_PARAMS and not placement.group.fetchable:
                continue
            try:
                trial = place(groups, {**levels, placement.group.name: nxt}, setup, budget_bytes)
            except HostMemoryError as error:
                host_refused.append(error)
                continue
            except PlanError:  # the last experts DeepSpeed's optimizer must keep
                continue
            freed = plan.device_bytes - trial.device_bytes
            added = trial.moved_bytes_per_step - plan.moved_bytes_per_step
            # A step that frees nothing by itself (the first host_params layer pays for the prefetch buffer)
            # is taken only when no step frees anything, so that later ones can.
            key = (freed > 0, freed / max(added, 1) if freed > 0 else freed, -order, placement.group.index)
            candidates.append((key, placement.group.name, nxt, trial))
        if not candidates and host_refused:
            missing = plan.device_bytes - budget_bytes
            least = min(error.plan.host_allocated_bytes for error in host_refused)
            raise HostMemoryError(
                f"granular_offload: nothing fits both the device budget of {format_bytes(budget_bytes)} and "
                f"host_memory {format_bytes(setup.host_memory_bytes)} ({setup.host_memory_bytes} bytes) per rank: "
                f"the furthest placement within host_memory needs {format_bytes(plan.device_bytes)} on the device, "
                f"{format_bytes(missing)} ({missing} bytes) missing, and offloading one more group needs at least "
                f"{format_bytes(least)} ({least} bytes) of host memory{_pinned_note(setup)}; raise "
                f"granular_offload.host_memory or device_memory, or the data-parallel size",
                plan,
            )
        if not candidates:
            missing = plan.device_bytes - budget_bytes
            raise PlanError(
                f"granular_offload: nothing fits the device budget of {format_bytes(budget_bytes)}: with every group "
                f"at its furthest allowed level ({allowed[-1].value}) the device needs {format_bytes(plan.device_bytes)}, "
                f"{format_bytes(missing)} ({missing} bytes) missing; raise the budget, the data-parallel size or the "
                f"ZeRO stage, or lower the activation memory",
                plan,
            )
        _, name, nxt, plan = max(candidates, key=lambda c: c[0])
        levels[name] = nxt
    return plan


def layer_groups(layer_numels: Sequence[int], other_numel: int, layer_uses: Optional[Sequence[int]] = None
                 ) -> List[GroupSize]:
    """Groups named ``layer<i>`` for each layer, plus ``other`` when there are non-layer parameters."""
    uses = layer_uses or [1] * len(layer_numels)
    groups = [GroupSize(f"layer{i}", n, i, u) for i, (n, u) in enumerate(zip(layer_numels, uses))]
    if other_numel:
        groups.append(GroupSize(OTHER, other_numel))
    return groups


def uniform_groups(num_layers: int, layer_params: int, other_params: int = 0, shared_groups: Optional[int] = None,
                   expert_params: int = 0, expert_dp_size: Optional[int] = None) -> List[GroupSize]:
    """Groups of a model of ``num_layers`` equal layers; with ``shared_groups`` G (a pseudo model) only the G group
    leaders own parameters, each used by L / G layers. ``expert_params`` (per layer, on this rank) become their own
    groups ``layer<i>.experts``, partitioned over ``expert_dp_size`` ranks, listed after the dense layers."""
    groups_count = shared_groups or num_layers
    size = num_layers // groups_count
    leaders = [g * size for g in range(groups_count)]
    groups = [GroupSize(f"layer{i}", layer_params, i, size) for i in leaders]
    if expert_params:
        groups += [GroupSize(f"layer{i}{EXPERTS}", expert_params, i, size, expert_dp_size) for i in leaders]
    if other_params:
        groups.append(GroupSize(OTHER, other_params))
    return groups


def estimate_activation_bytes(micro_batch: int, seq_len: int, hidden: int, heads: int, num_layers: int,
                              dtype: str = "bf16", checkpointing: bool = False) -> int:
    """Activation memory of a GPT-style transformer stack (Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per
    layer in 16-bit; with full checkpointing only each layer's input s*b*h*2 bytes plus one layer recomputed)."""
    scale = DTYPE_BYTES[dtype] / 2
    per_layer = micro_batch * seq_len * hidden * (34 + 5 * heads * seq_len / hidden)
    if checkpointing:
        return int(scale * (2 * micro_batch * seq_len * hidden * num_layers + per_layer))
    return int(scale * per_layer * num_layers)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    """``"32GB"`` -> 32e9, ``"32GiB"`` -> 32 * 2**30, an int -> itself."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count like 34359738368, '32GB' or '32GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a byte count >= 0, got {value!r}")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"expected a byte count like 34359738368, '32GB' or '32GiB', got {value!r}")
    return int(float(match[1]) * _UNITS[(match[2] or "B").lower()])


def format_bytes(count: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def describe_plan(plan: OffloadPlan) -> str:
    """The plan as a table: runs of consecutive groups at the same level collapsed into one row."""
    s = plan.setup
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none (explicit levels)"
    head = (f"granular offload plan: {s.dtype}, ZeRO stage {s.zero_stage}, data-parallel {s.dp_size}, "
            f"gradient accumulation {s.gradient_accumulation_steps}, budget {budget}")
    rows = [("groups", "level", "params each", "device each", "host each", "moved/step each")]
    runs: List[List[GroupPlacement]] = []
    for p in plan.placements:
        last = runs[-1][-1] if runs else None
        if (last and last.level is p.level and last.group.numel == p.group.numel and last.group.is_layer
                and p.group.is_layer and last.group.name.split(".")[1:] == p.group.name.split(".")[1:]):
            runs[-1].append(p)
        else:
            runs.append([p])
    for run in runs:
        first, last = run[0], run[-1]
        name = first.group.name if len(run) == 1 else f"{first.group.name}..{last.group.name} ({len(run)})"
        b = first.bytes
        rows.append((name, first.level.value, f"{first.group.numel:,}", format_bytes(b.device),
                     format_bytes(b.host), format_bytes(b.moved_per_step)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head] + ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    counts = {lvl.value: sum(p.level is lvl for p in plan.placements) for lvl in LEVEL_ORDER}
    rounding = plan.host_allocated_bytes - plan.host_bytes
    backups = plan.backup_bytes
    lines += [
        f"groups per level: {counts}; device total {format_bytes(plan.device_bytes)} ({plan.device_bytes} B) "
        f"(reserved {format_bytes(s.reserved_bytes)}, {plan.side_streams} side stream pools "
        f"{format_bytes(plan.stream_pool_bytes)}; backward: activations {format_bytes(s.activation_bytes)}, "
        f"prefetch buffer {format_bytes(plan.prefetch_buffer_bytes)}, streamed gradients "
        f"{format_bytes(plan.streamed_gradient_bytes)}, reduce bucket {format_bytes(s.reduce_bucket_bytes)}"
        + (f", accumulated gradients {format_bytes(plan.accumulated_gradient_bytes)}"
           if plan.accumulated_gradient_bytes else "")
        + f"; step: flat gradients {format_bytes(plan.flat_gradient_bytes)})",
        f"host per rank {format_bytes(plan.host_allocated_bytes)} ({plan.host_allocated_bytes} B): tensors "
        f"{format_bytes(plan.host_bytes)}"
        + (f" (the overlapped host step's backups {format_bytes(backups)}: a step may be refused)" if backups else "")
        + (f", pinned in whole pages +{format_bytes(rounding)} (+{100 * rounding / plan.host_bytes:.2f} %)"
           if plan.host_bytes and s.pinned_host else "")
        + ("" if s.host_memory_bytes is None else f"; host_memory {format_bytes(s.host_memory_bytes)}"),
        *(["pin_memory false: the host buffers are pageable, so every copy between host and device is synchronous "
           "(the copies overlap neither the layers nor the host Adam)"]
          if s.pageable_copies and any(p.level is not PlacementLevel.DEVICE for p in plan.placements) else []),
        f"moved per optimizer step {format_bytes(plan.moved_bytes_per_step)}; modelled offload time per optimizer "
        f"step {plan.offload_seconds_per_step:.3g} s = PCIe {plan.transfer_seconds:.3g} s (at "
        f"{s.pcie_bytes_per_s / 1e9:g} GB/s) + host Adam {plan.host_adam_seconds:.3g} s "
        f"({plan.host_stepped_numel:,} params at {s.cpu_adam_params_per_s:.3g}/s)",
    ]
    return "\n".join(lines)

