"""The engine-owning controller: a DeepSpeed engine stand-in that runs callbacks and performs the delink.

Owns: the current engine (pseudo, then real), the training state, the callback list, the in-process delink
(gather full fp32 weights and moments, on the device unless the job offloads -> destroy -> build the real model in
the working dtype, each shared value read once for all its layers, where it will train: the engine's device,
granular offload's host_params layers in their host allocations -> new engine, its fp32 masters set from the
gathered weights -> carry steps, LR schedule and the optimizer state per policy) and checkpoint save/load across
stages. Sharing math lives in ``sharing``, trigger and policy math in ``transition``, DeepSpeed internals in
``ds_state``.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import os
import shutil
import sys
import time
import uuid
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt
from . import ds_state, run_lock
from .callbacks import PSEUDO, REAL, CallbackList, TrainingCallback, TrainingControl, TrainingState
from .config import (
    MAIN_JOB_SECTIONS,
    PLUGIN_SECTIONS,
    SECTION,
    ConfigError,
    OptimizerStatePolicy,
    PlateauMetric,
    PseudoToRealConfig,
    split_checkpoint_options,
)
from .device import rank_device, use_rank_device
from .sharing import (
    apply_sharing,
    delink_layers,
    fill_copies,
    get_layer_list,
    group_leader,
    layer_index_of,
    parameter_like,
    truncate_layers,
)
from .transition import StageTransitionCallback, lr_factor, member_moments

CLIENT_KEY = ckpt.CLIENT_KEY
RETIRED_MODULE = ("this module was the pseudo model, which the delink replaced by the real one; train, evaluate and "
                  "save through the engine ds_pseudo_real.initialize returned, and read the model as engine.module")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    if is_rank0():
        print(f"[ds_pseudo_real] {message}", flush=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def copy_with_parameters(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> nn.Module:
    """Deep copy of ``model`` whose parameters are ``make(param)`` (ties kept; buffers copied).

    Pre-seeding ``deepcopy``'s memo keeps Parameter attributes that ``Parameter.__deepcopy__`` drops and never
    copies the parameters' data.
    """
    memo: Dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = make(param)
    return copy.deepcopy(model, memo)


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (ties kept, buffers real): a building plan."""
    return copy_with_parameters(model, lambda p: parameter_like(p, torch.empty_like(p, device="meta")))


def working_dtype(ds_config: Dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed trains the model's parameters in: bf16 or fp16 when enabled, else fp32."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    return torch.float16 if (ds_config.get("fp16") or {}).get("enabled") else torch.float32


def _parameter_names(skeleton: nn.Module, weights: Optional[Mapping[str, torch.Tensor]]) -> Dict[int, str]:
    """{id: name} of the skeleton's parameters (a tie under its first name), every one of them in ``weights``."""
    names = {id(param): name for name, param in skeleton.named_parameters()}
    missing = [name for name in names.values() if weights is not None and name not in weights]
    if missing:
        raise KeyError(f"no weights for real-model parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return names


# Where the delink keeps the gathered fp32 pseudo weights and moments while it builds the next stage: on the host.
# They are full (unpartitioned) on every rank whatever the ZeRO stage, 12 bytes per pseudo parameter: on the device
# they would add that to the real stage's peak there (more than the real stage itself holds per rank under ZeRO 3 on
# enough ranks). The gather moves them off the device a parameter at a time, as DeepSpeed hands each over, and the
# build reads them back a piece at a time (``fill_copies``); the host holds them, as it does when the job offloads.
GATHERED_ON = torch.device("cpu")


class Starts(Mapping):
    """The values the next stage's parameters start from, by name: views of the gathered pseudo weights (many names
    to one tensor), and with ``noise`` > 0 (``pseudo_to_real.delink_noise``) for every copy but each group's first
    layer the shared value plus Gaussian noise of ``noise`` x its standard deviation, drawn on the CPU from a
    generator keyed by the name (the same on every rank and device). A noisy value is made when it is read, for the
    caller to write and drop: at most one is held at a time, never every copy at once (the real model's layers in
    fp32). ``peak_bytes``: the largest made so far."""

    def __init__(self, shared: Dict[str, torch.Tensor], noise: float, layer_path: str):
        self._shared = shared
        self._noise = noise
        self._noisy = set()
        seen = set()
        for name, value in shared.items():
            if (noise and id(value) in seen and layer_index_of(name, layer_path) is not None
                    and value.is_floating_point() and value.numel() >= 2):
                self._noisy.add(name)
            seen.add(id(value))
        self.peak_bytes = 0

    def made_on_read(self, name: str) -> bool:
        """Whether ``self[name]`` is a new (noisy) tensor made for that parameter alone."""
        return name in self._noisy

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._shared[name]
        if name not in self._noisy:
            return value
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float32).to(value.device)
        made = noise.mul_(self._noise * value.float().std()).add_(value.float()).to(value.dtype)
        self.peak_bytes = max(self.peak_bytes, made.numel() * made.element_size())
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self._shared)

    def __len__(self) -> int:
        return len(self._shared)


def _cast(param: nn.Parameter, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and param.is_floating_point() else param.dtype


def _give_storage(unit: nn.Module, names: Dict[int, str], made: Dict[int, nn.Parameter],
                  weights: Optional[Mapping[str, torch.Tensor]], dtype: Optional[torch.dtype],
                  device: Optional[torch.device] = None, views: Optional[Dict[int, torch.Tensor]] = None) -> None:
    """Give the meta parameters of ``unit`` storage on ``device`` (the CPU when None; ties kept through ``made``),
    or the view ``views`` holds for it, floating ones in ``dtype`` when given, then fill them from ``weights``: the
    parameters that start from one tensor (the layers of a shared set) together, each piece of it read once; those
    whose value :class:`Starts` makes when read (noisy copies) one at a time, each value dropped once written."""
    copies: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = {}  # by the source's id: (source, its copies)
    own: List[Tuple[torch.Tensor, str]] = []  # (parameter, name) filled from a value made for it alone
    for module in unit.modules():
        for key, param in list(module._parameters.items()):
            if param is None or (id(param) not in made and param.device.type != "meta"):
                continue
            if id(param) not in made:
                storage = (views or {}).get(id(param))
                if storage is None:
                    storage = torch.empty_like(param, device=device or "cpu", dtype=_cast(param, dtype))
                real = parameter_like(param, storage)
                name = names.get(id(param))
                if isinstance(weights, Starts) and weights.made_on_read(name):
                    own.append((real, name))
                elif weights is not None:
                    source = weights[name]
                    copies.setdefault(id(source), (source, []))[1].append(real)
                made[id(param)] = real
            module._parameters[key] = made[id(param)]
    for source, targets in copies.values():
        fill_copies(targets, source)
    for real, name in own:
        fill_copies([real], weights[name])


def materialize(skeleton: nn.Module, weights: Optional[Mapping[str, torch.Tensor]],
                dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                views: Optional[Dict[int, torch.Tensor]] = None) -> nn.Module:
    """Give the skeleton's parameters real storage on ``device`` (the CPU when None; ties kept), or the storage
    ``views`` holds for a parameter's id (granular offload's host layers), filled from ``weights`` when given, in
    ``dtype`` (floating parameters; the engine's working dtype, which DeepSpeed would cast them to) or their own:
    each parameter is made in that dtype where it will train and filled there (the parameters that start from one
    tensor together), so the model is never held in a wider dtype than it trains in, nor anywhere else."""
    names = _parameter_names(skeleton, weights)
    _give_storage(skeleton, names, {}, weights, dtype, device, views)
    return skeleton


def _libc_malloc_trim():
    """glibc's ``malloc_trim``, or None (not Linux, or a C library without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def return_freed_host_memory() -> None:
    """Give the host memory the process freed back to the OS (glibc ``malloc_trim``; elsewhere nothing). glibc
    keeps freed blocks below its mmap threshold (which it raises up to 32 MiB as large blocks are freed) in its heaps,
    so the pseudo engine's tensors and the per-parameter buffers the engine build frees would otherwise stay resident
    while the real stage's (larger, freshly mapped) buffers are allocated next to them."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def parameter_numel(model: nn.Module) -> int:
    """Distinct parameter elements; ZeRO-3 partitioned parameters report their full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def _sync_lr_with_scheduler(scheduler, optimizer) -> None:
    """Set the optimizer's LRs to what ``scheduler`` gives at its current position (after load_state_dict)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    elif hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(scheduler.last_batch_iteration)


def _copy_lrs(old: List[float], optimizer) -> None:
    groups = optimizer.param_groups
    if len(old) == len(groups):
        values = old
    elif len(set(old)) == 1:
        values = old[:1] * len(groups)
    else:
        raise RuntimeError(
            f"cannot carry per-group learning rates across the delink: {len(old)} groups before, {len(groups)} after"
        )
    for group, lr in zip(groups, values):
        group["lr"] = lr


class CurrentOf:
    """What ``initialize`` returns for the optimizer and the LR scheduler: a view of the controller's current one.

    Attributes and methods are those of the current engine's object, so code written against the returned optimizer
    keeps working after the delink, and holding it does not keep the pseudo engine (whose optimizer is linked to it
    through DeepSpeed's hooks) alive.
    """

    def __init__(self, controller: "PseudoToRealController", name: str):
        object.__setattr__(self, "_controller", controller)
        object.__setattr__(self, "_name", name)

    def current(self):
        return getattr(self._controller, self._name)

    def __getattr__(self, attribute: str):
        return getattr(self.current(), attribute)

    def __setattr__(self, attribute: str, value) -> None:
        setattr(self.current(), attribute, value)

    def __repr__(self) -> str:
        return f"CurrentOf({self._name}: {self.current()!r})"


class PseudoToRealController:
    """Use it like a DeepSpeed engine: ``loss = engine(batch); engine.backward(loss); engine.step()``.

    Any attribute not defined here is read from the current DeepSpeed engine, which is replaced at the delink:
    hold on to the controller, not to ``controller.engine``, ``.optimizer`` or ``.lr_scheduler``.
    """

    def __init__(
        self,
        model: nn.Module,
        ds_config: Dict[str, Any],
        ptr_config: PseudoToRealConfig,
        *,
        optimizer: Optional[Callable] = None,
        model_parameters: Optional[Callable[[nn.Module], Iterable]] = None,
        lr_scheduler: Optional[Callable] = None,
        training_data=None,
        collate_fn=None,
        mpu=None,
        callbacks: Iterable[TrainingCallback] = (),
    ):
        for name, value, what in (
            ("optimizer", optimizer, "a callable(params) -> torch.optim.Optimizer"),
            ("model_parameters", model_parameters, "a callable(model) -> parameters or param groups"),
            ("lr_scheduler", lr_scheduler, "a callable(optimizer) -> scheduler"),
        ):
            if value is not None and not callable(value):
                raise TypeError(
                    f"{name}: got a {type(value).__name__}; pass None or {what}, so that it can be built again for "
                    f"the real model at the delink"
                )
        use_rank_device()  # before the offload plan's store and streams and the engine are made
        self.config = ptr_config
        ds_config, self.checkpoint_options = split_checkpoint_options(ds_config)
        self._prepared_dirs: set = set()
        self.ds_config = {k: v for k, v in ds_config.items() if k not in PLUGIN_SECTIONS + MAIN_JOB_SECTIONS}
        self.full_ds_config = ds_config
        self._optimizer_factory = optimizer
        self._params_fn = model_parameters
        self._scheduler_factory = lr_scheduler
        self._mpu = mpu
        self.layer_path = ptr_config.layers
        self.num_layers = len(get_layer_list(model, self.layer_path))
        # fails early, naming the key, if a stage's groups does not divide L or does not split the stage before
        self.stages = ptr_config.stages(self.num_layers) if ptr_config.enabled else [(self.num_layers,) * 2]
        self.stage_groups = [groups for _, groups in self.stages]
        self.depth, self.groups = self.stages[0]
        if SECTION not in ds_config:
            log_rank0(f"no '{SECTION}' section in the config: Pseudo-to-Real is off, the real model trains from step 0")
        elif not ptr_config.enabled:
            log_rank0(f"{SECTION}.enabled is false: Pseudo-to-Real is off, the real model trains from step 0")
        if ptr_config.enabled and self.depth == self.num_layers:
            apply_sharing(model, self.layer_path, self.groups)
        self._skeleton = meta_skeleton(model)
        if self.depth < self.num_layers:  # a shallow start: the first layers only
            truncate_layers(model, self.layer_path, self.depth)
        self.state = TrainingState(stage=PSEUDO if ptr_config.enabled else REAL, groups=self.groups)
        self.control = TrainingControl()
        builtin = [StageTransitionCallback(ptr_config.triggers())] if ptr_config.enabled else []
        self.callbacks = CallbackList(builtin + list(callbacks))
        self._track_train_loss = ptr_config.enabled and any(
            t.on_plateau is not None and t.on_plateau.metric == PlateauMetric.TRAINING.value for t in ptr_config.triggers())
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._lr_factor = 1.0
        self.last_transition: Optional[Dict[str, Any]] = None
        self.offload_plan = None
        self.engine = None
        self._monitor = None
        self.engine, self.optimizer, self.training_dataloader, self.lr_scheduler = self._initialize(
            model, training_data, collate_fn
        )
        # rank 0's id for this controller names its temporary folders; it is also the run's id until it resumes
        # from a checkpoint, whose run it then goes on as
        self._writer = ckpt.gather(uuid.uuid4().hex[:12])[0]
        self.run_id = self._writer
        self.callbacks.fire("on_train_begin", self.state, self.control)

    # ---- engine construction -------------------------------------------------------------------------------
    def _initialize(self, model: nn.Module, training_data=None, collate_fn=None):
        params = self._params_fn(model) if self._params_fn else [p for p in model.parameters() if p.requires_grad]
        optimizer = self._optimizer_factory
        ds_config = self.ds_config
        if "granular_offload" in self.full_ds_config:
            from .offload import build_offload_optimizer, describe_offload_plan

            self._refuse_model_parallelism()
            client, ds_config, plan = build_offload_optimizer(model, self.full_ds_config, self.layer_path,
                                                              self._data_parallel_size())
            if client is not None:
                optimizer, params = client, None
                self.offload_plan = plan
                log_rank0(f"granular offload plan for the {self.state.stage} model:\n{describe_offload_plan(plan)}")
        engine, opt, loader, scheduler = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=self._scheduler_factory,
            training_data=training_data,
            collate_fn=collate_fn,
            mpu=self._mpu,
            # the run's monitor is handed on below: no writer (and empty event file) of this engine's own
            config=ds_config if self._monitor is None else ds_state.without_monitors(ds_config),
        )
        # the transition reads and writes this engine's optimizer state; save_checkpoint wraps its checkpoint engine
        ds_state.check_internals(engine, *(["pseudo_to_real"] if self.config.enabled else []), "save_checkpoint",
                                 "monitors")
        if self.offload_plan is not None:
            from .offload import attach_to_engine

            attach_to_engine(engine)
        if self._monitor is not None:  # one TensorBoard/CSV/W&B writer for the whole run, across the delink
            engine.monitor = self._monitor
        ds_state.warn_on_failed_monitor_writes(engine, ckpt.warn)
        target = ds_state.basic_optimizer(engine)
        if target is not None:
            target.register_step_pre_hook(self._scale_lr)
            target.register_step_post_hook(self._unscale_lr)
        return engine, opt, loader, scheduler

    def _refuse_model_parallelism(self) -> None:
        """Granular offload is written for data (and expert) parallelism: its groups outside DeepSpeed's optimizer
        are reduced over DeepSpeed's data-parallel group, but tensor, pipeline or sequence parallel layers (split
        parameters, stages, sequence shards) are not handled, so they are refused until supported."""
        mpu, config = self._mpu, self.full_ds_config
        sizes = {
            "tensor parallel (mpu)": getattr(mpu, "get_tensor_model_parallel_world_size", lambda: 1)(),
            "pipeline parallel (mpu)": getattr(mpu, "get_pipeline_model_parallel_world_size", lambda: 1)(),
            # the mpu interface DeepSpeed documents (Megatron-DeepSpeed's) and its pipeline grid name them so
            "model parallel (mpu)": getattr(mpu, "get_model_parallel_world_size", lambda: 1)(),
            "pipeline parallel (mpu grid)": getattr(mpu, "get_pipe_parallel_world_size", lambda: 1)(),
            "tensor_parallel.autotp_size": (config.get("tensor_parallel") or {}).get("autotp_size", 1),
            "sequence_parallel_size": config.get("sequence_parallel_size", 1),
        }
        used = {name: size for name, size in sizes.items() if size and size > 1}
        if used:
            raise ConfigError(
                f"granular_offload works with data (and expert) parallelism only; this run has {used}. Remove the "
                f"granular_offload section, or run without tensor, pipeline and sequence parallelism"
            )

    def _scale_lr(self, optimizer, *_):
        """Step pre-hook: the stage's LR factor (``pseudo_lr_scale``, the re-warmup) applies to this optimizer step
        only (ZeRO steps group by group); the scheduler keeps the schedule's values."""
        if self._lr_factor != 1.0:
            self._unscaled_lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] *= self._lr_factor

    def _unscale_lr(self, optimizer, *_):
        if self._lr_factor != 1.0:
            for group, lr in zip(optimizer.param_groups, self._unscaled_lrs):
                group["lr"] = lr

    def __getattr__(self, name: str):
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    # ---- the training-loop surface --------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.engine.module.training:
            first = next((a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)), None)
            if first is not None:
                self.state.tokens_seen += first.numel() * self.engine.dp_world_size
        return self.engine(*args, **kwargs)

    def backward(self, loss, **kwargs):
        """``loss`` is a tensor, or a model output object holding one as ``.loss`` (Hugging Face ``ModelOutput``)."""
        if not torch.is_tensor(loss) and torch.is_tensor(getattr(loss, "loss", None)):
            loss = loss.loss
        if self._track_train_loss:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1
        return self.engine.backward(loss, **kwargs)

    def step(self, **kwargs):
        boundary = self.engine.is_gradient_accumulation_boundary()
        since = None if self.state.switch_step is None else self.engine.global_steps - self.state.switch_step
        self._lr_factor = lr_factor(self.state.stage == PSEUDO, self.config.pseudo_lr_scale, since,
                                    self.config.rewarmup_steps)
        result = self.engine.step(**kwargs)
        self._lr_factor = 1.0
        if boundary:
            self.state.global_step = self.engine.global_steps
            if self._track_train_loss and self._loss_count:
                self.state.last_train_loss = float(self._loss_sum) / self._loss_count
                self._loss_sum, self._loss_count = None, 0
            self.callbacks.fire("on_step_end", self.state, self.control)
            self._maybe_delink()
        return result

    def report_eval(self, metrics: Dict[str, float]) -> None:
        """Hand evaluation metrics (e.g. ``{"val_loss": 2.1}``) to the callbacks; may delink right away."""
        self.callbacks.fire("on_evaluate", self.state, self.control, metrics)
        self._maybe_delink()

    @property
    def stage(self) -> str:
        return self.state.stage

    def _maybe_delink(self) -> None:
        if self.control.should_delink and self.state.stage == PSEUDO:
            self.control.should_delink = False
            self.delink()

    # ---- the delink ----------------------------------------------------------------------------------------
    def _source_name(self, name: str, old: Tuple[int, int], new: Tuple[int, int]) -> Tuple[str, int]:
        """The parameter of the ``old`` stage's model (layers, parameter groups) that ``name``, a parameter of the
        ``new`` stage's model, starts from, and how many of the new sets split each old one: a group's first layer
        when the sets split (their number), the same layer of the stacked copy when a shallow model grows (1)."""
        index = layer_index_of(name, self.layer_path)
        if index is None:
            return name, 1
        (depth, groups), (new_depth, new_groups) = old, new
        if new_depth > depth:
            source, members = index % depth, 1
        else:
            source, members = group_leader(index, depth, groups), new_groups // groups
        prefix = f"{self.layer_path}.{index}."
        position = name.index(prefix)
        return name[:position] + f"{self.layer_path}.{source}." + name[position + len(prefix):], members

    def _build_engine(self, depth: int, groups: int, weights: Optional[Mapping[str, torch.Tensor]]) -> Dict[str, float]:
        """The model of ``depth`` layers in ``groups`` parameter sets (``num_layers`` twice: the real model) from the
        skeleton, with ``weights`` (every layer's names) or uninitialized storage, and its engine; returns the
        seconds of its phases (``model``: storage and values, ``engine``: ``deepspeed.initialize``, ``masters``: the
        fp32 masters set from ``weights``)."""
        start = time.perf_counter()
        skeleton = copy_with_parameters(self._skeleton, lambda p: parameter_like(p, torch.empty_like(p)))
        delink_layers(skeleton, self.layer_path)
        if depth < self.num_layers:
            truncate_layers(skeleton, self.layer_path, depth)
        if groups < depth:
            apply_sharing(skeleton, self.layer_path, groups)
        dtype = working_dtype(self.ds_config)
        device = rank_device()
        if (self.ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
            model = self._materialize_partitioned(skeleton, weights, dtype, device)
        else:
            model = materialize(skeleton, weights, dtype, device, self._host_param_views(skeleton, dtype, device))
        built = time.perf_counter()
        self.depth, self.groups = depth, groups
        self.state.groups = groups
        self.state.stage = REAL if (depth, groups) == (self.num_layers, self.num_layers) else PSEUDO
        self.engine, self.optimizer, _, self.lr_scheduler = self._initialize(model)
        initialized = time.perf_counter()
        if weights is not None and dtype != torch.float32:
            # DeepSpeed made the fp32 masters from the working-dtype parameters, rounded: give them the full values
            ds_state.set_full_fp32_params(self.engine, weights)
        return {"model": round(built - start, 3), "engine": round(initialized - built, 3),
                "masters": round(time.perf_counter() - initialized, 3)}

    def _host_param_views(self, skeleton: nn.Module, dtype: torch.dtype, device: torch.device
                          ) -> Optional[Dict[int, torch.Tensor]]:
        """Host storage for the layers granular offload will plan at ``host_params`` (pinned as it pins them), laid
        out as its ``HostParamStore`` keeps them, so that they are built in their final place; None without the
        section."""
        if "granular_offload" not in self.full_ds_config:
            return None
        from .offload import host_params_placement
        from .offload.params import host_param_views

        ids, pin = host_params_placement(skeleton, self.full_ds_config, self.layer_path, self._data_parallel_size())
        if not ids:
            return None
        return host_param_views(get_layer_list(skeleton, self.layer_path), ids, lambda p: _cast(p, dtype),
                                pin and device.type == "cuda")

    def _data_parallel_size(self) -> int:
        """The ranks ZeRO partitions over (the mpu's data-parallel group, else the world)."""
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        return getattr(self._mpu, "get_data_parallel_world_size", lambda: world)()

    def _materialize_partitioned(self, skeleton: nn.Module, weights: Optional[Mapping[str, torch.Tensor]],
                                 dtype: torch.dtype, device: Optional[torch.device] = None) -> nn.Module:
        """ZeRO-3: give the skeleton storage one layer at a time (then the rest), in the engine's dtype, and hand
        each to ``deepspeed.zero.Init(module=...)``, which keeps this rank's partition and frees the rest, so that a
        rank never holds more than one layer of the model in full."""
        planned = list(skeleton.named_parameters())  # kept alive: ids in ``names`` must not be reused by new tensors
        names = _parameter_names(skeleton, weights)
        made: Dict[int, nn.Parameter] = {}
        for unit in [*get_layer_list(skeleton, self.layer_path), skeleton]:
            _give_storage(unit, names, made, weights, dtype, device)
            deepspeed.zero.Init(module=unit, config_dict_or_path=self.ds_config, dtype=dtype, mpu=self._mpu)
        del planned
        return skeleton

    def _build_real_engine(self, real_weights: Optional[Dict[str, torch.Tensor]]) -> Dict[str, float]:
        return self._build_engine(self.num_layers, self.num_layers, real_weights)

    @property
    def next_stage(self) -> Optional[Tuple[int, int]]:
        """(layers, parameter groups) of the stage the next transition goes to (None in the last stage)."""
        index = self.state.transitions_done + 1
        return self.stages[index] if index < len(self.stages) and self.state.stage == PSEUDO else None

    @property
    def next_trigger(self):
        """The trigger of the next transition (a ``SwitchTrigger``), None in the last stage."""
        triggers = self.config.triggers()
        done = self.state.transitions_done
        return triggers[done] if self.next_stage is not None and done < len(triggers) else None

    def _release_engine(self) -> None:
        from .offload.pinned import empty_host_cache

        remove_hooks = getattr(ds_state.basic_optimizer(self.engine), "remove_hooks", None)
        if remove_hooks is not None:  # granular offload's fetch and gradient hooks live on the old model
            remove_hooks()
        self._monitor = self.engine.monitor
        module = self.engine.module
        self.engine.destroy()
        ds_state.retire_module(module, RETIRED_MODULE)
        self.engine = self.optimizer = self.lr_scheduler = None
        gc.collect()
        return_freed_host_memory()
        empty_host_cache()  # the pinned blocks torch's host allocator kept of the pseudo engine's

    def delink(self) -> Dict[str, Any]:
        """Turn the pseudo engine into the next stage's, in process: the real one, or with a progressive schedule
        the model with the next stage's groups (every group split into equal runs of consecutive layers, each run
        starting from the group's values); returns (and logs) what was done."""
        if self.next_stage is None:
            raise RuntimeError(f"delink() called in the {self.state.stage} stage, with no stage after it")
        start = clock = time.perf_counter()
        phases: Dict[str, float] = {}

        def lap(name: str) -> None:  # seconds since the previous phase ended
            nonlocal clock
            now = time.perf_counter()
            phases[name], clock = round(now - clock, 3), now

        old = self.engine
        policy = self.config.optimizer_state
        pseudo_numel, pseudo_total = parameter_numel(old.module), ds_state.total_parameter_numel(old.module)
        pseudo_memory = ds_state.memory_report(old)
        pseudo_plan = self.offload_plan
        weights, moments = ds_state.gather_full_state(old, policy != OptimizerStatePolicy.RESET.value, GATHERED_ON)
        gathered = sum(t.numel() * t.element_size() for t in [
            *weights.values(), *(t for per in moments.values() for t in per.values())])
        counters = ds_state.step_counters(old)
        lrs = [g["lr"] for g in old.optimizer.param_groups]
        scheduler_state = old.lr_scheduler.state_dict() if old.lr_scheduler is not None else None
        steps = {k: getattr(old, k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}
        del old
        lap("gather")
        self._release_engine()
        lap("release")
        old, new = (self.depth, self.groups), self.next_stage
        (old_depth, old_groups), (new_depth, new_groups) = old, new
        every_layer = [name for name, _ in self._skeleton.named_parameters(remove_duplicate=False)]
        sources = {name: self._source_name(name, old, new)[0] for name in every_layer
                   if layer_index_of(name, self.layer_path) is None or layer_index_of(name, self.layer_path) < new_depth}
        # views (materialize copies them into place); a name missing from ``weights`` is a tie to another
        # parameter outside the layers (e.g. a head tied to the embedding), which materialize fills through it
        starts = Starts({name: weights[source] for name, source in sources.items() if source in weights},
                        self.config.delink_noise, self.layer_path)
        lap("starts")
        phases.update(self._build_engine(new_depth, new_groups, starts))
        held = gathered + starts.peak_bytes  # the gathered state and, beside it, the largest noisy copy
        del weights, starts
        clock = time.perf_counter()
        return_freed_host_memory()  # the per-parameter tensors DeepSpeed flattened or partitioned, freed in the build
        self.state.transitions_done += 1
        engine = self.engine
        for key, value in steps.items():
            setattr(engine, key, value)
        if scheduler_state is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(scheduler_state)
        _copy_lrs(lrs, engine.optimizer)
        carried = 0
        if moments:
            unwritten = ds_state.seed_optimizer_state(engine, counters)
            copies: Dict[str, Tuple[int, List[nn.Parameter]]] = {}  # by shared parameter: (members, its copies)
            for name, param in engine.module.named_parameters():
                source, members = self._source_name(name, old, new)
                if source in moments:
                    copies.setdefault(source, (members, []))[1].append(param)
            swapped = []  # the copies in sub-groups ZeRO-3 swaps to NVMe, written a sub-group at a time after
            for source, (members, params) in copies.items():  # one shared parameter's moments at a time
                start_moments = member_moments(policy, moments.pop(source), members)
                resident, elsewhere = ds_state.held_in_memory(engine, params)
                ds_state.set_full_moments_of_copies(engine, resident, start_moments, unwritten)
                if elsewhere:
                    swapped.append((elsewhere, start_moments))
                carried += len(params)
            unwritten.zero_rest()  # padding, and parameters whose source had no moments
            ds_state.write_swapped_moments(engine, counters, swapped)
            ds_state.replay_cpu_adam_steps(engine)
        lap("carry")  # steps, LR schedule and the optimizer state
        self.state.switch_step = self.engine.global_steps
        report = {
            "step": self.engine.global_steps,
            "seconds": round(time.perf_counter() - start, 3),
            "groups_before": old_groups,
            "groups_after": new_groups,
            "layers_before": old_depth,
            "layers_after": new_depth,
            "parameters_before": pseudo_numel,  # this rank's
            "parameters_after": parameter_numel(engine.module),
            "parameters_before_total": pseudo_total,  # the model's, over every rank
            "parameters_after_total": ds_state.total_parameter_numel(engine.module),
            "optimizer_state": policy,
            "moments_carried": carried,
            "memory_before": pseudo_memory,
            "memory_after": ds_state.memory_report(engine),
            "rewarmup_steps": self.config.rewarmup_steps,
            "phases": phases,
            "gathered": {"device": str(GATHERED_ON), "bytes": gathered, "peak_bytes": held},
        }
        if pseudo_plan is not None or self.offload_plan is not None:
            report["offload_plan_before"] = pseudo_plan
            report["offload_plan_after"] = self.offload_plan
        self.last_transition = report
        self._log_transition(report)
        self.callbacks.fire("on_delink", self.state, report)
        return report

    def _log_transition(self, report: Dict[str, Any]) -> None:
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        log_rank0(
            f"delinked at step {report['step']} in {report['seconds']:.2f}s: parameters per rank "
            f"{report['parameters_before']:,} -> {report['parameters_after']:,}, in total "
            f"{report['parameters_before_total']:,} -> {report['parameters_after_total']:,}; optimizer state "
            f"'{report['optimizer_state']}'"
            f" ({report['moments_carried']} tensors carried); LR re-warmup {report['rewarmup_steps']} steps; "
            f"parameter groups {report['groups_before']} -> {report['groups_after']}"
            + (f", layers {report['layers_before']} -> {report['layers_after']} (stacked)"
               if report["layers_before"] != report["layers_after"] else "")
            + " (" + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in report["phases"].items()) + ")"
            + f"; pseudo state gathered on {report['gathered']['device']}: {mib(report['gathered']['bytes'])}"
            + f" (held at most {mib(report['gathered']['peak_bytes'])} with what the delink made of it)"
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        for when in ("before", "after"):
            mem = report[f"memory_{when}"]
            print(
                f"[ds_pseudo_real] rank {rank} memory {'pseudo' if when == 'before' else 'real'}: "
                + ", ".join(f"{k} {mib(v)}" for k, v in mem.items()),
                flush=True,
            )

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def _plugin_state(self) -> Dict[str, Any]:
        return {"state": self.state.to_dict(), "callbacks": self.callbacks.state_dict()}

    def _sidecar(self, kind: str = "deepspeed") -> Dict[str, Any]:
        return {
            "kind": kind,
            "stage": self.state.stage,
            "global_step": self.engine.global_steps,
            "layers": self.layer_path,
            "num_layers": self.num_layers,
            "groups": self.groups,
            "depth": self.depth,
            "zero_stage": self.engine.zero_optimization_stage(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "run_id": self.run_id,
        }

    def _prepare_dir(self, folder: str) -> None:
        """Once per folder and run, before the first save or load there: rank 0 creates it, takes its lock for the
        life of the process (:func:`~ds_pseudo_real.checkpoint.claim`: another run holding it is a CheckpointError on
        every rank) and removes what crashed saves left (after a barrier, so that no rank is still writing)."""
        if folder in self._prepared_dirs:
            return
        _barrier()
        ckpt.claim(folder)
        if is_rank0():
            ckpt.remove_stale(folder)
        _barrier()
        self._prepared_dirs.add(folder)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict] = None) -> str:
        """Write a checkpoint atomically: ``<tag>.<writer>.partial`` by every rank (each file checksummed as it is
        written and fsynced), then rank 0 adds the manifest and renames it to ``<tag>`` + ``latest``, then applies
        ``checkpoint.keep_last`` to this run's checkpoints. A ``tag`` that names another run's checkpoint is refused
        before anything is written, and so is every save once the folder's lock file names another run
        (:class:`~ds_pseudo_real.checkpoint.CheckpointError` on every rank). A failed write on any rank raises
        CheckpointError on every rank, naming the file and the last good checkpoint; the partial folder is removed
        and training can go on (a later save can succeed once the cause is gone)."""
        tag = tag or f"global_step{self.engine.global_steps}"
        client = dict(client_state or {})
        client[CLIENT_KEY] = self._plugin_state()
        self._prepare_dir(save_dir)
        refusal = (run_lock.taken_over(save_dir) or ckpt.foreign_checkpoint(save_dir, tag, self.run_id)
                   if is_rank0() else None)
        refusal = ckpt.gather(refusal)[0]
        if refusal is not None:
            raise ckpt.CheckpointError(f"checkpoint {os.path.join(save_dir, tag)} was not saved: {refusal}")
        staged = os.path.join(save_dir, ckpt.partial_tag(tag, self._writer))
        written, failure = {}, None
        try:
            with ds_state.checksummed_writes(self.engine, staged) as written:
                self.engine.save_checkpoint(save_dir, tag=os.path.basename(staged), client_state=client,
                                            save_latest=False)
        except (OSError, RuntimeError) as error:
            failure = error
            _barrier()  # the closing barrier of DeepSpeed's save_checkpoint, which this rank skipped
        self._raise_if_save_failed(save_dir, tag, failure)
        every = ckpt.gather(written)
        fingerprints = ckpt.gather(ds_state.state_fingerprint(self.engine))  # compared after a load, per rank
        swap_files = ckpt.gather(ds_state.swapped_state_files(self.engine))  # NVMe: each rank's saved files
        if is_rank0():
            try:
                merged = {name: entry for part in every for name, entry in part.items()}
                swapped = {"swapped_state_files": swap_files} if any(f is not None for f in swap_files) else {}
                sidecar = {**self._sidecar(), "written_by": run_lock.holder_record(save_dir), "state": fingerprints,
                           **swapped}
                ckpt.publish(save_dir, tag, sidecar, merged, self._writer)
            except OSError as error:
                failure = error
        self._raise_if_save_failed(save_dir, tag, failure)
        if is_rank0():
            ckpt.prune(save_dir, self.checkpoint_options.keep_last, self.run_id)
        _barrier()
        return os.path.join(save_dir, tag)

    def _raise_if_save_failed(self, save_dir: str, tag: str, failure: Optional[BaseException]) -> None:
        """Collective: every rank raises when any rank's part of the save failed; rank 0 removes the partial folder."""
        reports = ckpt.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        ranks = [rank for rank, report in enumerate(reports) if report]
        if not ranks:
            return
        staged = os.path.join(save_dir, ckpt.partial_tag(tag, self._writer))
        if is_rank0():
            shutil.rmtree(staged, ignore_errors=True)
        _barrier()
        raise ckpt.CheckpointError(
            f"could not save checkpoint {os.path.join(save_dir, tag)} (rank {', '.join(map(str, ranks))}): "
            f"{reports[ranks[0]]}; the partial folder {staged} was removed and the run's state is intact; "
            f"{ckpt.last_good(save_dir)}"
        ) from failure

    def load_checkpoint(self, load_dir: Optional[str], tag: Optional[str] = None, *, verify: Optional[str] = None,
                        **kwargs) -> Tuple[Optional[str], Dict]:
        """Resume from a checkpoint of either stage (or a converted one); becomes real first when it is a real one.

        ``tag`` None: the newest checkpoint in ``load_dir`` that verifies (damaged newer ones are moved aside with a
        warning; :class:`~ds_pseudo_real.checkpoint.CheckpointError` when checkpoints exist but none verifies);
        ``(None, {})`` when ``load_dir`` holds none. ``tag`` given (a tag in ``load_dir`` or the path of a checkpoint
        folder): that one, which must verify. ``verify`` overrides ``checkpoint.verify`` (checksum, size, none).
        The run then goes on as the checkpoint's run (its saves may replace that run's later checkpoints); with
        ``tag`` None, rank 0 first takes ``load_dir``'s lock, as the first save there does.
        """
        mode = verify or self.checkpoint_options.verify
        if tag is None:
            if load_dir is None:
                raise ValueError("load_checkpoint: give load_dir, or tag as the path of a checkpoint folder")
            self._prepare_dir(load_dir)
            chosen = ckpt.select_resume(load_dir, mode)
            if chosen is None:
                self.rewind_monitors()  # the run starts here: what an earlier one logged after this step goes
                return None, {}
            tag, verdict = chosen
        else:
            load_dir, tag = ckpt.resolve(load_dir, tag)
            verdict = ckpt.verify(load_dir, tag, mode)
            if not verdict.ok:
                raise ckpt.CheckpointError(
                    f"checkpoint {verdict.folder} cannot be loaded: {'; '.join(verdict.problems)}"
                )
        log_rank0(verdict.summary())
        side = ckpt.read_sidecar(load_dir, tag)
        self._check_compatible(load_dir, tag, side)
        if side["kind"] == "converted":
            return self._load_converted(load_dir, tag, side)
        stage = (self.num_layers,) * 2 if side["stage"] == REAL else (side.get("depth", self.num_layers), side["groups"])
        if stage != (self.depth, self.groups):  # a later stage's checkpoint: that stage's model first
            self._release_engine()
            self._build_engine(*stage, None)
        loading = dict(kwargs)
        if side.get("swapped_state_files") and ds_state.swapped_state_files(self.engine) is not None:
            # DeepSpeed loads ZeRO-3 weights without the optimizer state through zero_to_fp32, which cannot read
            # sub-groups swapped to NVMe; under NVMe its full load reads no optimizer state anyway (it only copies
            # the swap files): _restore_swapped_state puts back the weights, and the moments only if asked
            loading["load_optimizer_states"] = True
        try:
            path, client = self.engine.load_checkpoint(load_dir, tag, **loading)
        except Exception as error:
            raise ckpt.CheckpointError(
                f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}: {type(error).__name__}: {error}; "
                f"{'it verified' if verdict.ok and not verdict.legacy and mode != 'none' else 'it was not verified'}"
                f" (checkpoint.verify: {mode}); resume from another one with --resume-from TAG|PATH: "
                f"{[c.tag for c in ckpt.list_checkpoints(load_dir) if c.tag != tag]}"
            ) from error
        if path is None:
            raise ckpt.CheckpointError(f"DeepSpeed could not load checkpoint {load_dir}/{tag}")
        optimizer_loaded = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        self._restore_swapped_state(os.path.join(load_dir, tag), side, optimizer_loaded)
        if optimizer_loaded:
            ds_state.replay_cpu_adam_steps(self.engine)
        self._check_state_restored(os.path.join(load_dir, tag), side, optimizer_loaded)
        client = dict(client or {})
        self._restore_plugin_state(client.pop(CLIENT_KEY))
        self.rewind_monitors()
        self.run_id = ckpt.run_of(side)  # resumed: this run goes on as the checkpoint's
        log_rank0(f"resumed from {os.path.join(load_dir, tag)} at step {self.engine.global_steps} ({self.state.stage} stage)")
        return path, client

    def rewind_monitors(self) -> None:
        """Drop what DeepSpeed's TensorBoard and CSV monitors logged after the current step (an interrupted run's
        tail; CSV rows kept in ``<file>.discarded``), so that the run's monitor output reads as one run's.
        ``load_checkpoint`` does it; call it when a run starts over without loading one."""
        ds_state.rewind_monitors(self.engine)

    def _restore_swapped_state(self, folder: str, side: Dict[str, Any], optimizer_loaded: bool) -> None:
        """Under ZeRO-3 with ``offload_optimizer: nvme``, restore the fp32 masters and working weights, and (when the
        optimizer state is loaded) the moments and step counters, that DeepSpeed's load leaves out (:func:`~ds_pseudo_real.ds_state.restore_swapped_optimizer_state`), from the
        checkpoint's files named as the sidecar records. A failure on any rank is a
        :class:`~ds_pseudo_real.checkpoint.CheckpointError` on every rank."""
        saved = side.get("swapped_state_files")
        if saved is None or ds_state.swapped_state_files(self.engine) is None:
            return
        rank, world = ckpt.rank_and_world()
        failure = None
        try:
            if len(saved) != world or saved[rank] is None:
                raise RuntimeError(f"the checkpoint names the swap files of {len(saved)} ranks; this run has {world}")
            ds_state.restore_swapped_optimizer_state(self.engine, folder, saved[rank], moments=optimizer_loaded)
        except (OSError, RuntimeError, KeyError) as error:
            failure = f"{type(error).__name__}: {error}"
        reports = ckpt.gather(failure)
        ranks = [r for r, report in enumerate(reports) if report]
        if ranks:
            raise ckpt.CheckpointError(
                f"could not restore the optimizer state swapped to NVMe from checkpoint {folder} (rank "
                f"{', '.join(map(str, ranks))}): {reports[ranks[0]]}")
        ds_state.regather_persistent_parameters(self.engine)

    def _check_state_restored(self, folder: str, side: Dict[str, Any], optimizer_loaded: bool) -> None:
        """Collective: raise :class:`~ds_pseudo_real.checkpoint.CheckpointError` on every rank when DeepSpeed's load
        left any rank with other weights, or (when it loaded the optimizer state) other fp32 masters or moments, than
        that rank saved (its :func:`~ds_pseudo_real.ds_state.state_fingerprint` in the sidecar), instead of training
        on from them. Checkpoints saved without fingerprints are not checked."""
        saved = side.get("state")
        rank, world = ckpt.rank_and_world()
        if saved is not None and len(saved) != world:  # ZeRO 0 on another world size: every rank holds all
            saved = [saved[0]] * world if self.engine.zero_optimization_stage() == 0 else None
        expected = saved[rank] if saved is not None else None
        found = ds_state.state_fingerprint(self.engine) if expected is not None else None
        differ = []
        for part in ("weights", "optimizer") if optimizer_loaded else ("weights",):
            if found is not None and expected.get(part) is not None and any(
                    abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(found[part], expected[part])):
                differ.append(part)
        reports = ckpt.gather(differ)
        ranks = [r for r, parts in enumerate(reports) if parts]
        if ranks:
            names = {"weights": "weights", "optimizer": "optimizer state (fp32 masters, moments)"}
            what = " and ".join(names[p] for p in names if any(p in parts for parts in reports))
            swapped = " (ZeRO-3 with offload_optimizer nvme: the swapped sub-groups were read from the checkpoint's "\
                      "offloaded_tensors files)" if ds_state.swapped_sub_groups(self.engine) else ""
            here = (f"; on rank {rank}: " + ", ".join(f"{p} sum and sum of squares {found[p]}, saved {expected[p]}"
                                                      for p in differ)) if differ else ""
            raise ckpt.CheckpointError(
                f"DeepSpeed loaded checkpoint {folder}, but the {what} of rank {', '.join(map(str, ranks))} are not "
                f"the ones saved{swapped}{here}; training on would silently start from another state")

    def _check_compatible(self, load_dir: str, tag: str, side: Dict[str, Any]) -> None:
        """Refuse, before DeepSpeed reads anything, a checkpoint this run cannot load, saying what to do instead."""
        where = f"checkpoint {os.path.join(load_dir, tag)}"
        if side["num_layers"] != self.num_layers or side["layers"] != self.layer_path:
            raise ConfigError(
                f"{where} has {side['num_layers']} layers at {side['layers']!r}; "
                f"this model has {self.num_layers} at {self.layer_path!r}"
            )
        converted = f"{os.path.normpath(load_dir)}_converted"
        if side["stage"] == PSEUDO and self.state.stage == REAL:
            raise ConfigError(
                f"{where} is a pseudo-stage checkpoint but this run is in the real stage "
                f"(pseudo_to_real.enabled is false?); expand it to the real model with `ds-pseudo-real convert "
                f"--to-real --input {load_dir} --tag {tag} --output {converted}` and resume from "
                f"{os.path.join(converted, tag)}"
            )
        saved = (side.get("depth", self.num_layers), side["groups"])
        if side["stage"] == PSEUDO and saved not in self.stages:
            raise ConfigError(f"{where} has {saved[1]} parameter groups of {saved[0]} layers; this run's stages have "
                              f"{self.stage_groups[:-1] if self.stage_groups[-1] == self.num_layers else self.stage_groups}"
                              f" (pseudo_to_real.groups or schedule)")
        if side["kind"] == "converted":
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        zero = self.engine.zero_optimization_stage()
        saved_world, saved_zero = side.get("world_size", world), side.get("zero_stage", zero)
        if saved_zero != zero or (zero > 0 and saved_world != world):
            raise ckpt.CheckpointError(
                f"{where} was saved by {saved_world} ranks at ZeRO stage {saved_zero}; this run has {world} ranks at "
                f"ZeRO stage {zero}, and DeepSpeed's ZeRO optimizer state only loads on the layout that saved it. "
                f"Convert it, then resume from the converted one, which keeps the weights, steps, LR schedule, "
                f"trigger state and its stage (a pseudo-stage one goes on in the pseudo stage and delinks where "
                f"configured); Adam moments start at zero:\n  ds-pseudo-real convert --input {load_dir} --tag {tag} "
                f"--output {converted}\nand run with --resume-from {os.path.join(converted, tag)} "
                f"(or go back to {saved_world} ranks at ZeRO stage {saved_zero})"
            )

    def _restore_plugin_state(self, plugin: Dict[str, Any]) -> None:
        self.state = TrainingState.from_dict(plugin["state"])
        self.state.groups = self.groups  # checkpoints before progressive schedules do not record it
        if self.state.stage == REAL and self.config.enabled:
            self.state.transitions_done = len(self.stages) - 1
        self.callbacks.load_state_dict(plugin["callbacks"])

    def _load_converted(self, load_dir: str, tag: str, side: Dict[str, Any]) -> Tuple[str, Dict]:
        """A checkpoint of ``ds-pseudo-real convert``: the model of its stage built from its fp32 weights, its steps,
        LR schedule position and plugin state restored; Adam moments start at zero."""
        folder = os.path.join(load_dir, tag)
        weights = torch.load(os.path.join(folder, "model_fp32.pt"), map_location="cpu", weights_only=True)
        trainer = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=False)
        self._release_engine()
        if side["stage"] == REAL:
            self._build_real_engine(weights)
        else:
            self._build_engine(side.get("depth", self.num_layers), side["groups"], weights)
        for key in ("global_steps", "global_samples", "skipped_steps"):
            setattr(self.engine, key, trainer[key])
        self.engine.micro_steps = trainer["global_steps"] * self.engine.gradient_accumulation_steps()
        if trainer.get("lr_scheduler") is not None and self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
            _sync_lr_with_scheduler(self.engine.lr_scheduler, self.engine.optimizer)
        client = dict(trainer.get("client_state") or {})
        plugin = client.pop(CLIENT_KEY, None)
        if plugin is not None:
            self._restore_plugin_state(plugin)
        if side["stage"] == REAL:
            self.state.stage = REAL
            self.state.switch_step = self.state.switch_step or self.engine.global_steps
        self.rewind_monitors()
        self.run_id = ckpt.run_of(side)
        log_rank0(f"loaded converted {side['stage']}-stage checkpoint {folder} at step {self.engine.global_steps}; Adam "
                  f"moments start at zero")
        return folder, client
