"""Each stage's model and DeepSpeed engine, and the delink that turns one stage's engine into the next one's.

Owns: building a stage's model from the meta skeleton where it trains, its engine, releasing it, and the delink's
phases and report (what it carries from one engine to the next: ``carry``). Must not touch checkpoints, callbacks
or the training loop; DeepSpeed internals stay in ``ds_state``.
"""
from __future__ import annotations

import ctypes
import gc
import sys
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from . import ds_state
from .callbacks import PSEUDO, REAL, TrainingState
from .carry import EngineProgress, carry_moments
from .config import ConfigError, OptimizerStatePolicy, PseudoToRealConfig
from .device import rank_device
from .logs import logger
from .ranks import log_rank0
from .sharing import (
    apply_sharing,
    copy_with_parameters,
    delink_layers,
    fill_copies,
    get_layer_list,
    layer_index_of,
    meta_skeleton,
    parameter_like,
    source_parameter,
    truncate_layers,
)
from .training_facts import TrainingFacts

if TYPE_CHECKING:
    from .offload.config import GranularOffloadConfig

RETIRED_MODULE = ("this module was the pseudo model, which the delink replaced by the real one; train, evaluate and "
                  "save through the engine ds_pseudo_real.initialize returned, and read the model as engine.module")
DESTROYED_MODULE = "this module's engine was destroyed (engine.destroy()), which released its weights"

# Where the delink keeps the gathered fp32 pseudo weights and moments while it builds the next stage: on the host.
# They are full (unpartitioned) on every rank whatever the ZeRO stage, 12 bytes per pseudo parameter: on the device
# they would add that to the real stage's peak there (more than the real stage itself holds per rank under ZeRO 3 on
# enough ranks). The gather moves them off the device a parameter at a time, as DeepSpeed hands each over, and the
# build reads them back a piece at a time (``fill_copies``); the host holds them, as it does when the job offloads.
GATHERED_ON = torch.device("cpu")


def parameter_numel(model: nn.Module) -> int:
    """Distinct parameter elements; ZeRO-3 partitioned parameters report their full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# ---- a stage's model: the meta skeleton given storage where it trains ------------------------------------------
def _parameter_names(skeleton: nn.Module, weights: Optional[Mapping[str, torch.Tensor]]) -> Dict[int, str]:
    """{id: name} of the skeleton's parameters (a tie under its first name), every one of them in ``weights``."""
    names = {id(param): name for name, param in skeleton.named_parameters()}
    missing = [name for name in names.values() if weights is not None and name not in weights]
    if missing:
        raise KeyError(f"no weights for real-model parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return names


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

    def __contains__(self, name: object) -> bool:  # Mapping's would make a noisy copy to answer
        return name in self._shared

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
    named: List[Tuple[torch.Tensor, str]] = []  # (parameter, the name of its value in ``weights``)
    for module in unit.modules():
        for key, param in list(module._parameters.items()):
            if param is None or (id(param) not in made and param.device.type != "meta"):
                continue
            if id(param) not in made:
                storage = (views or {}).get(id(param))
                if storage is None:
                    storage = torch.empty_like(param, device=device or "cpu", dtype=_cast(param, dtype))
                real = parameter_like(param, storage)
                if weights is not None:
                    named.append((real, names.get(id(param))))
                made[id(param)] = real
            module._parameters[key] = made[id(param)]
    fill_from(named, weights)


def fill_from(named: List[Tuple[torch.Tensor, str]], weights: Mapping[str, torch.Tensor]) -> None:
    """Write into each (tensor, name) of ``named`` the value ``weights`` has for its name: the tensors that start
    from one value together, each piece of it read once; those whose value :class:`Starts` makes when read (noisy
    copies) one at a time, each value dropped once written."""
    copies: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = {}  # by the source's id: (source, its copies)
    own: List[Tuple[torch.Tensor, str]] = []  # (tensor, name) filled from a value made for it alone
    for target, name in named:
        if isinstance(weights, Starts) and weights.made_on_read(name):
            own.append((target, name))
        else:
            source = weights[name]
            copies.setdefault(id(source), (source, []))[1].append(target)
    for source, targets in copies.values():
        fill_copies(targets, source)
    for target, name in own:
        fill_copies([target], weights[name])


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


# ---- what the process gives back between two engines -----------------------------------------------------------
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


def refuse_model_parallelism(training: TrainingFacts) -> None:
    """Granular offload plans the layers and slices a rank holds when it is given the model, and reduces its own
    groups over DeepSpeed's data-parallel group (the mpu's under tensor or pipeline parallelism). Two layouts break
    that and are refused: DeepSpeed's AutoTP splits the layers inside ``deepspeed.initialize``, after the plan and
    the optimizer's groups were made from the whole ones; sequence parallelism (Ulysses) averages gradients over
    the sequence-data-parallel group, which the own groups' reduction does not use."""
    sizes = {
        "tensor_parallel.autotp_size": training.tensor_parallel_size,
        "sequence_parallel_size": training.sequence_parallel_size,
    }
    used = {name: size for name, size in sizes.items() if size and size > 1}
    if used:
        raise ConfigError(
            f"granular_offload works with data, expert, tensor (layers split by the model, an mpu given) and "
            f"pipeline parallelism; this run has {used}. Remove the granular_offload section, or split the layers "
            f"in the model (Megatron-style, with an mpu) instead of AutoTP, and run without sequence parallelism"
        )


class StageBuilder:
    """Builds the DeepSpeed engine of every stage of the run, from one meta skeleton of the caller's model, and holds
    the current one (``engine``, ``optimizer``, ``lr_scheduler``, ``offload_plan``; its layout ``depth`` layers in
    ``groups`` parameter sets). What it builds it records in the ``TrainingState`` it is handed (stage, groups, and
    across a delink the transitions done and the switch step).

    The run's typed config parts: ``ptr_config`` (the stages), ``granular_offload`` (None without it),
    ``training`` (DeepSpeed's dtype, ZeRO stage and data-parallel size) and ``ds_config``, what each
    ``deepspeed.initialize`` gets. ``step_hooks``: the optimizer step's pre and post hooks, registered on every
    engine's optimizer (the controller's stage LR factor).
    """

    def __init__(self, model: nn.Module, ptr_config: PseudoToRealConfig,
                 granular_offload: Optional[GranularOffloadConfig], training: TrainingFacts,
                 ds_config: Dict[str, Any], *, optimizer: Optional[Callable],
                 model_parameters: Optional[Callable[[nn.Module], Any]], lr_scheduler: Optional[Callable], mpu,
                 step_hooks: Tuple[Callable, Callable]):
        self.layer_path = ptr_config.layers
        self._name_path = self.layer_path  # where the names the delink maps hold their layer index
        self.num_layers = self._count_layers(model)
        # fails early, naming the key, if a stage's groups does not divide L or does not split the stage before
        self.stages = ptr_config.stages(self.num_layers) if ptr_config.enabled else [(self.num_layers,) * 2]
        self.depth, self.groups = self.stages[0]
        self._policy = ptr_config.optimizer_state
        self._noise = ptr_config.delink_noise
        self._rewarmup_steps = ptr_config.rewarmup_steps
        # the transition reads and writes each engine's optimizer state; save_checkpoint wraps its checkpoint engine
        self._internals = (*(["pseudo_to_real"] if ptr_config.enabled else []), "save_checkpoint", "monitors")
        self._ds_config = ds_config  # what deepspeed.initialize gets
        self._granular = granular_offload
        self._training = training
        self._dtype = training.torch_dtype
        self._zero3 = training.zero_stage == 3
        self._optimizer_factory = optimizer
        self._params_fn = model_parameters
        self._scheduler_factory = lr_scheduler
        self._mpu = mpu
        self._step_hooks = step_hooks
        self.engine = self.optimizer = self.lr_scheduler = None
        self.offload_plan = None
        self._monitor = None
        self._first_model = self._prepare(model, ptr_config)

    # ---- the model's layout: what a model of another kind (a PipelineModule) does its own way ------------------
    def _count_layers(self, model: nn.Module) -> int:
        return len(get_layer_list(model, self.layer_path))

    def _prepare(self, model: nn.Module, ptr_config: PseudoToRealConfig) -> nn.Module:
        """The model the first stage trains (the caller's, its layers tied or truncated in place), and the meta
        skeleton every later stage's model is built from."""
        if ptr_config.enabled and self.depth == self.num_layers:
            apply_sharing(model, self.layer_path, self.groups)
        self._skeleton = meta_skeleton(model)
        if self.depth < self.num_layers:  # a shallow start: the first layers only
            truncate_layers(model, self.layer_path, self.depth)
        return model

    def _parameter_names(self) -> List[str]:
        """Every name a parameter of a stage's model may have, in the names the delink maps."""
        return [name for name, _ in self._skeleton.named_parameters(remove_duplicate=False)]

    def _mapped_name(self, name: str) -> str:
        """The name the delink maps for the model's parameter ``name``: the same here."""
        return name

    def _total_parameter_numel(self, model: nn.Module) -> int:
        """The model's distinct parameter elements over every rank (collective)."""
        return ds_state.total_parameter_numel(model)

    def _by_mapped_name(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """``values`` (by the model's parameter names) by the names the delink maps."""
        return {self._mapped_name(name): value for name, value in values.items()}

    def _by_model_name(self, values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``values`` (by mapped name) as the current model names its parameters."""
        return values

    # ---- engines ----------------------------------------------------------------------------------------------
    def start(self, stage: str, training_data=None, collate_fn=None):
        """The first stage's engine, from the caller's model; returns DeepSpeed's training data loader."""
        model, self._first_model = self._first_model, None
        return self._new_engine(model, stage, training_data, collate_fn)

    def _new_engine(self, model: nn.Module, stage: str, training_data=None, collate_fn=None):
        params = self._params_fn(model) if self._params_fn else [p for p in model.parameters() if p.requires_grad]
        optimizer = self._optimizer_factory
        ds_config = self._ds_config
        if self._granular is not None:
            from .offload import describe_offload_plan, offload_optimizer

            refuse_model_parallelism(self._training)
            optimizer, ds_config, self.offload_plan = offload_optimizer(model, self._granular, self._training,
                                                                        ds_config, self.layer_path)
            params = None
            log_rank0(f"granular offload plan for the {stage} model:\n{describe_offload_plan(self.offload_plan)}")
        engine, engine_optimizer, loader, scheduler = deepspeed.initialize(
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
        ds_state.check_internals(engine, *self._internals)
        if self.offload_plan is not None:
            from .offload import attach_to_engine

            attach_to_engine(engine)
        if self._monitor is not None:  # one TensorBoard/CSV/W&B writer for the whole run, across the delink
            engine.monitor = self._monitor
        ds_state.warn_on_failed_monitor_writes(engine, logger.warning)
        target = ds_state.basic_optimizer(engine)
        if target is not None:
            pre, post = self._step_hooks
            target.register_step_pre_hook(pre)
            target.register_step_post_hook(post)
        self.engine, self.optimizer, self.lr_scheduler = engine, engine_optimizer, scheduler
        return loader

    def build(self, depth: int, groups: int, weights: Optional[Mapping[str, torch.Tensor]],
              state: TrainingState) -> Dict[str, float]:
        """The model of ``depth`` layers in ``groups`` parameter sets (``num_layers`` twice: the real model) from the
        skeleton, with ``weights`` (every layer's names) or uninitialized storage, and its engine, recorded in
        ``state``; returns the seconds of its phases (``model``: storage and values, ``engine``:
        ``deepspeed.initialize``, ``masters``: the fp32 masters set from ``weights``)."""
        start = time.perf_counter()
        model = self._build_model(depth, groups, weights)
        built = time.perf_counter()
        self.depth, self.groups = depth, groups
        state.groups = groups
        state.stage = REAL if (depth, groups) == (self.num_layers, self.num_layers) else PSEUDO
        self._new_engine(model, state.stage)
        initialized = time.perf_counter()
        if weights is not None and self._dtype != torch.float32:
            # DeepSpeed made the fp32 masters from the working-dtype parameters, rounded: give them the full values
            ds_state.set_full_fp32_params(self.engine, self._by_model_name(weights))
        return {"model": round(built - start, 3), "engine": round(initialized - built, 3),
                "masters": round(time.perf_counter() - initialized, 3)}

    def _build_model(self, depth: int, groups: int, weights: Optional[Mapping[str, torch.Tensor]]) -> nn.Module:
        """The model of ``depth`` layers in ``groups`` parameter sets, from the skeleton, filled from ``weights``
        where it trains."""
        skeleton = copy_with_parameters(self._skeleton, lambda p: parameter_like(p, torch.empty_like(p)))
        delink_layers(skeleton, self.layer_path)
        if depth < self.num_layers:
            truncate_layers(skeleton, self.layer_path, depth)
        if groups < depth:
            apply_sharing(skeleton, self.layer_path, groups)
        device = rank_device()
        if self._zero3:
            return self._materialize_partitioned(skeleton, weights, self._dtype, device)
        return materialize(skeleton, weights, self._dtype, device,
                           self._host_param_views(skeleton, self._dtype, device))

    def _host_param_views(self, skeleton: nn.Module, dtype: torch.dtype, device: torch.device
                          ) -> Optional[Dict[int, torch.Tensor]]:
        """Host storage for the layers granular offload will plan at ``host_params`` (pinned as it pins them), laid
        out as its ``HostParamStore`` keeps them, so that they are built in their final place; None without the
        section."""
        if self._granular is None:
            return None
        from .offload import host_params_placement
        from .offload.params import host_param_views

        ids, pin = host_params_placement(skeleton, self._granular, self._training, self.layer_path)
        if not ids:
            return None
        return host_param_views(get_layer_list(skeleton, self.layer_path), ids, lambda p: _cast(p, dtype),
                                pin and device.type == "cuda")

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
            deepspeed.zero.Init(module=unit, config_dict_or_path=self._ds_config, dtype=dtype, mpu=self._mpu)
        del planned
        return skeleton

    def release(self, retired: str = RETIRED_MODULE) -> None:
        """Destroy the current engine and give back what it held (its monitor is kept for the next engine); a
        forward of its module raises ``RuntimeError(retired)``."""
        from .pinned import empty_host_cache

        remove_hooks = getattr(ds_state.basic_optimizer(self.engine), "remove_hooks", None)
        if remove_hooks is not None:  # granular offload's fetch and gradient hooks live on the old model
            remove_hooks()
        self._monitor = self.engine.monitor
        module = self.engine.module
        self.engine.destroy()
        ds_state.retire_module(module, retired)
        self.engine = self.optimizer = self.lr_scheduler = None
        gc.collect()
        return_freed_host_memory()
        empty_host_cache()  # the pinned blocks torch's host allocator kept of the pseudo engine's

    # ---- the delink -------------------------------------------------------------------------------------------
    def delink(self, new: Tuple[int, int], state: TrainingState) -> Dict[str, Any]:
        """Turn the current engine into the one of the ``new`` stage (layers, parameter groups), in process: gather
        the full fp32 weights and moments, release the engine, build the new model from them and its engine, carry
        steps, LR schedule and the optimizer state per ``pseudo_to_real.optimizer_state``; records the transition
        in ``state`` and returns (and logs) what was done."""
        laps = _Laps()
        before = self._engine_facts(self.engine)
        before["offload_plan"] = self.offload_plan
        weights, moments, progress = self._gather_state()
        gathered = sum(t.numel() * t.element_size() for t in [
            *weights.values(), *(t for per in moments.values() for t in per.values())])
        laps.lap("gather")
        self.release()
        laps.lap("release")
        old = (self.depth, self.groups)
        starts = self._starts(weights, old, new)
        laps.lap("starts")
        laps.phases.update(self.build(*new, starts, state))
        held = gathered + starts.peak_bytes  # the gathered state and, beside it, the largest noisy copy
        del weights, starts
        laps.restart()
        return_freed_host_memory()  # the per-parameter tensors DeepSpeed flattened or partitioned, freed in the build
        state.transitions_done += 1
        engine = self.engine
        progress.give_to(engine)

        def source_of(name: str) -> Tuple[str, int]:  # the old model's parameter a new one starts from
            return source_parameter(self._mapped_name(name), self._name_path, old, new)

        carried = carry_moments(engine, moments, progress.counters, self._policy, source_of) if moments else 0
        laps.lap("carry")  # steps, LR schedule and the optimizer state
        state.switch_step = engine.global_steps
        after = self._engine_facts(engine)
        report = {
            "step": engine.global_steps,
            "seconds": laps.total(),
            "groups_before": old[1],
            "groups_after": new[1],
            "layers_before": old[0],
            "layers_after": new[0],
            "parameters_before": before["parameters"],  # this rank's
            "parameters_after": after["parameters"],
            "parameters_before_total": before["parameters_total"],  # the model's, over every rank
            "parameters_after_total": after["parameters_total"],
            "optimizer_state": self._policy,
            "moments_carried": carried,
            "memory_before": before["memory"],
            "memory_after": after["memory"],
            "rewarmup_steps": self._rewarmup_steps,
            "phases": laps.phases,
            "gathered": {"device": str(GATHERED_ON), "bytes": gathered, "peak_bytes": held},
        }
        if before["offload_plan"] is not None or self.offload_plan is not None:
            report["offload_plan_before"] = before["offload_plan"]
            report["offload_plan_after"] = self.offload_plan
        log_transition(report)
        return report

    def _engine_facts(self, engine) -> Dict[str, Any]:
        """What a delink's report says of the engine before and after: its parameters (this rank's, the model's)
        and this rank's memory."""
        return {"parameters": parameter_numel(engine.module),
                "parameters_total": self._total_parameter_numel(engine.module),
                "memory": ds_state.memory_report(engine)}

    def _gather_state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]], EngineProgress]:
        """The current engine's full fp32 weights and (unless the policy resets them) moments, on ``GATHERED_ON``
        by the names of the skeleton, and where its training stands."""
        engine = self.engine
        weights, moments = ds_state.gather_full_state(engine, self._policy != OptimizerStatePolicy.RESET.value,
                                                      GATHERED_ON)
        return self._by_mapped_name(weights), self._by_mapped_name(moments), EngineProgress.of(engine)

    def _starts(self, weights: Dict[str, torch.Tensor], old: Tuple[int, int], new: Tuple[int, int]) -> Starts:
        """What each parameter of the ``new`` stage's model starts from: a view of the ``old`` one's weight it
        copies (a name missing from ``weights`` is a tie to another parameter outside the layers, e.g. a head tied
        to the embedding, which materialize fills through it)."""
        path = self._name_path
        kept = [name for name in self._parameter_names()  # the skeleton's layers past the new depth are not in it
                if layer_index_of(name, path) is None or layer_index_of(name, path) < new[0]]
        sources = {name: source_parameter(name, path, old, new)[0] for name in kept}
        return Starts({name: weights[source] for name, source in sources.items() if source in weights},
                      self._noise, path)


class _Laps:
    """The seconds of each phase of a delink, each since the previous one ended."""

    def __init__(self):
        self.start = self.clock = time.perf_counter()
        self.phases: Dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name], self.clock = round(now - self.clock, 3), now

    def restart(self) -> None:
        """What runs from here to the next lap is that lap's alone (the build's phases are its own)."""
        self.clock = time.perf_counter()

    def total(self) -> float:
        return round(time.perf_counter() - self.start, 3)


def log_transition(report: Dict[str, Any]) -> None:
    """A delink's report as log lines: the transition on rank 0, each rank's memory before and after."""
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
    for when in ("before", "after"):  # every rank's own figures; shown from the other ranks with all ranks' lines
        mem = report[f"memory_{when}"]
        logger.info(f"rank {rank} memory {'pseudo' if when == 'before' else 'real'}: "
                    + ", ".join(f"{k} {mib(v)}" for k, v in mem.items()))
