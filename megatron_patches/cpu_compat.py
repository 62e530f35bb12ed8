"""CPU compatibility layer: lets megatron.core, and Megatron-LM's training scripts, run on a CPU-only torch build
(tests, this project's CI, a user's smoke run).

Owns every patch this project applies to torch.cuda, megatron.core and megatron.training for the CPU, listed in
``PATCHES`` (applied by ``install()``) and ``TRAINING_PATCHES`` (added by ``install_training()`` for Megatron-LM's
``pretrain``), all undone by ``uninstall()``. It is never active when CUDA is available, and refuses a
megatron-core other than the one it was written against (0.16.x): the call sites it fixes move between releases.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch.overrides import TorchFunctionMode

WRITTEN_FOR_MEGATRON = "0.16."
#: What Megatron-LM's validate_args is told the device's architecture is: Blackwell's (10), the first without the
#: CUDA_DEVICE_MAX_CONNECTIONS=1 requirement for tensor/context parallelism.
NO_CONNECTION_LIMIT_ARCH = 10
_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: where, and why Megatron needs it on CPU."""

    target: str
    reason: str


PATCHES: List[Patch] = [
    Patch("torch.cuda.current_device", "Megatron passes it as device= when allocating weights and buffers"),
    Patch("torch.cuda.synchronize / empty_cache", "called unconditionally by timers and the MoE dispatchers"),
    Patch("torch.cuda.get_rng_state / set_rng_state / manual_seed", "the tensor-parallel RNG tracker forks CUDA RNG"),
    Patch("tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state", "same tracker, internal helpers"),
    Patch("logging.getLogger('megatron.core.tensor_parallel.random').filters: drops 'CPU RNG state changed within "
          "GPU RNG context'", "the tracker's CUDA generator is the CPU one here, so every dropout in its fork() "
          "changes it: one spurious warning per layer and step"),
    Patch("torch.cuda.Stream / current_stream / stream / Event", "MoE dispatchers and DDP record work on streams"),
    Patch("moe.moe_utils.te_general_gemm", "0.16.1 references it even when Transformer Engine is absent"),
    Patch("moe.token_dispatcher.maybe_move_tensor_to_cpu", "leaves CPU split sizes as tensors: all_to_all fails"),
    Patch("TorchFunctionMode: device='cuda' / .cuda() / .to('cuda') -> cpu",
          "DDP buffers, the optimizers and the pipeline schedules hard-code 'cuda'"),
    Patch("torch.Tensor.type() reports torch.cuda.*", "DistributedOptimizer and clip_grads check these strings"),
    Patch("transformer.torch_norm.WrappedTorchNorm.__new__: accepts sequence_parallel",
          "the local spec's only norm without apex/TE; MoE with TP>1 requires sequence parallelism"),
    Patch("optimizer.distrib_optimizer.DistributedOptimizer.state_dict: a never-stepped optimizer is given its "
          "states first (one step at lr 0)",
          "without apex/TE it reads Adam's step from the per-parameter states, which a fresh optimizer lacks "
          "('assert len(steps) == 1' on loading a dist checkpoint)"),
    Patch("optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict: every parameter's Adam step set to the "
          "checkpoint's, each its own tensor",
          "without apex/TE it gives every parameter one shared step tensor (torch's Adam then increments it once per "
          "parameter), which the dp_reshardable loader then overwrites with the placeholder state's step: a resumed "
          "run's bias correction, and its losses, drift from the uninterrupted run's"),
    Patch("optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states: a parameter's "
          "Adam step kept when the tensors given have none",
          "without apex/TE torch's Adam keeps 'step' per parameter; loading a fully_reshardable checkpoint (the "
          "TP/PP-reshardable one, --dist-ckpt-optim-fully-reshardable) gives no step there and failed with "
          "KeyError: 'step' (load_state_dict then sets it, see above)"),
]


#: Megatron-LM's training package (tag core_v0.16.1) on CPU, added by ``install_training``.
TRAINING_PATCHES: List[Patch] = [
    Patch("megatron.training.training.initialize_megatron: allow_no_cuda=True",
          "initialize_megatron asserts 'Megatron requires CUDA.' unless told otherwise"),
    Patch("torch.cuda.device_count -> 1, torch.cuda.set_device -> no-op",
          "initialize builds the model-parallel groups and seeds the model-parallel RNG tracker only when it counts "
          "a device"),
    Patch("megatron.legacy.fused_kernels.load -> no-op",
          "builds CUDA kernels (fails without CUDA_HOME); the local spec does not use them"),
    Patch("dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.async_loop: torch.cuda.device_count -> 1 "
          "and set_device -> no-op in the worker process",
          "--async-save's checkpoint worker (a spawned process, without the patches above) starts with "
          "torch.cuda.set_device(rank % torch.cuda.device_count()): ZeroDivisionError, and the run waits forever"),
    Patch("dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors: a copy of every "
          "tensor",
          "--async-save's snapshot is tensor.to('cpu'), a copy from a GPU but the live tensor itself on the CPU: the "
          "worker would write weights that training goes on changing (the trainer waits only for this preload)"),
    Patch("megatron.training.arguments.get_device_arch_version -> 10",
          "validate_args asks the GPU's architecture when TP or CP > 1 (to demand CUDA_DEVICE_MAX_CONNECTIONS=1 "
          "before Blackwell, 10): 'Torch not compiled with CUDA enabled'; a CPU has no CUDA queues to limit"),
]


class _FakeEvent:
    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _FakeEvent()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _FakeStream)

    def __hash__(self):
        return 0


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means cuda:N


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every request for a CUDA device into the CPU; pinned memory is dropped (no CUDA to pin for)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        tensor_method = bool(args) and isinstance(args[0], torch.Tensor)
        if tensor_method and name in ("cuda", "pin_memory"):
            return args[0]
        if tensor_method and name == "record_stream":
            return None
        if tensor_method and name == "to" and len(args) > 1 and not isinstance(args[1], int) and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Installed:
    """The saved originals, restored in reverse order by ``uninstall``."""

    def __init__(self):
        self.saved: List[tuple] = []
        self.mode: Optional[TorchFunctionMode] = None
        self.training = False  # whether install_training's patches are among ``saved``

    def set(self, owner: Any, name: str, value: Any) -> None:
        # A class's own entry, not what it inherits or the unwrapped function behind a staticmethod (__new__).
        saved = vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        self.saved.append((owner, name, saved))
        setattr(owner, name, value)


_STATE: Optional[_Installed] = None


def is_installed() -> bool:
    return _STATE is not None


def check_megatron_version() -> str:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(WRITTEN_FOR_MEGATRON):
        raise RuntimeError(
            f"megatron_patches.cpu_compat was written against megatron-core {WRITTEN_FOR_MEGATRON}x and patches its "
            f"internal call sites; found megatron-core {version}. Re-check every entry of PATCHES before enabling it."
        )
    return version


def install() -> bool:
    """Apply every patch in ``PATCHES``. Returns False (and does nothing) when CUDA is available."""
    global _STATE
    if torch.cuda.is_available():
        return False
    if _STATE is not None:
        return True
    check_megatron_version()
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    state = _Installed()
    cpu = torch.device("cpu")
    stream = _FakeStream()
    state.set(torch.cuda, "current_device", lambda: cpu)
    state.set(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    state.set(torch.cuda, "empty_cache", lambda: None)
    state.set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    state.set(torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    state.set(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    state.set(tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    state.set(tp_random, "_set_cuda_rng_state", lambda new_state, *args, **kwargs: torch.set_rng_state(new_state))
    rng_logger = logging.getLogger(tp_random.__name__)
    spurious = _drop_message("CPU RNG state changed within GPU RNG context")
    state.set(rng_logger, "filters", [*rng_logger.filters, spurious])
    state.set(torch.cuda, "Stream", _FakeStream)
    state.set(torch.cuda, "current_stream", lambda *args, **kwargs: stream)
    state.set(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    state.set(torch.cuda, "Event", lambda *args, **kwargs: _FakeEvent())
    if not hasattr(moe_utils, "te_general_gemm"):
        state.set(moe_utils, "te_general_gemm", None)
    state.set(token_dispatcher, "maybe_move_tensor_to_cpu",
              _cpu_aware_move(token_dispatcher.maybe_move_tensor_to_cpu))
    state.set(torch.Tensor, "type", _cuda_type_string(torch.Tensor.type))
    state.set(WrappedTorchNorm, "__new__", staticmethod(_sequence_parallel_norm(WrappedTorchNorm.__new__)))
    state.set(DistributedOptimizer, "state_dict", _with_optimizer_states(DistributedOptimizer.state_dict))
    state.set(DistributedOptimizer, "load_state_dict", _own_step_tensors(DistributedOptimizer.load_state_dict))
    state.set(DistributedOptimizer, "_set_main_param_and_optimizer_states",
              _keep_missing_step(DistributedOptimizer._set_main_param_and_optimizer_states))
    state.mode = _CudaToCpuMode()
    state.mode.__enter__()
    _STATE = state
    return True


def install_training() -> bool:
    """Apply ``TRAINING_PATCHES`` on top of ``install()``'s, for Megatron-LM's ``pretrain`` (needs ``megatron.training``
    importable). Returns False (and does nothing) when CUDA is available."""
    if not install():
        return False
    if _STATE.training:
        return True
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.arguments as arguments
    import megatron.training.training as training_module
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    initialize_megatron = training_module.initialize_megatron

    def initialize_megatron_without_cuda(*args, **kwargs):
        return initialize_megatron(*args, **{**kwargs, "allow_no_cuda": True})

    _STATE.set(training_module, "initialize_megatron", initialize_megatron_without_cuda)
    _STATE.set(torch.cuda, "device_count", lambda: 1)
    _STATE.set(torch.cuda, "set_device", lambda device: None)
    _STATE.set(fused_kernels, "load", lambda args: None)
    _STATE.set(arguments, "get_device_arch_version", lambda: NO_CONNECTION_LIMIT_ARCH)
    _STATE.set(PersistentAsyncCaller, "async_loop", staticmethod(_async_loop_on_cpu))
    _STATE.set(FileSystemWriterAsync, "preload_tensors", staticmethod(_preload_copies))
    _STATE.training = True
    return True


def uninstall() -> None:
    """Restore every patched attribute and leave the device-rewriting mode."""
    global _STATE
    if _STATE is None:
        return
    _STATE.mode.__exit__(None, None, None)
    for owner, name, original in reversed(_STATE.saved):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _STATE = None


# The two functions below are handed to --async-save's spawned worker process by reference (pickled by name), so
# they live at module level.
def _async_loop_on_cpu(*args, **kwargs):
    """``PersistentAsyncCaller.async_loop`` in the worker process, which imports megatron-core afresh (unpatched):
    it asks CUDA for a device first."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    return vars(PersistentAsyncCaller)["async_loop"].__func__(*args, **kwargs)


def _preload_copies(write_buckets, non_blocking=True):
    """``FileSystemWriterAsync.preload_tensors`` (megatron-core 0.16), copying: the snapshot the trainer waits for."""
    return [(file_name, storage_key, (bytes_data, [(item, tensor.to("cpu", copy=True)) for item, tensor in tensors]))
            for file_name, storage_key, (bytes_data, tensors) in write_buckets]


def _drop_message(message: str) -> Callable:
    return lambda record: record.getMessage() != message


def _cpu_aware_move(original: Callable) -> Callable:
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _cuda_type_string(original: Callable) -> Callable:
    def type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original(self, dtype, non_blocking, **kwargs)

    return type


def _with_optimizer_states(original: Callable) -> Callable:
    def state_dict(self):
        if not self.optimizer.state:
            from megatron_patches.delink import zero_lr

            with zero_lr(self.optimizer):  # Adam at lr 0 leaves the weights as they are
                self._init_optimizer_states_with_dummy_values()
        return original(self)

    return state_dict


def _own_step_tensors(original: Callable) -> Callable:
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        steps = {group["step"] for group in state_dict["optimizer"]["param_groups"] if "step" in group}
        if len(steps) != 1:
            return
        step = float(steps.pop())
        for param_state in self.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=param_state["step"].dtype)

    return load_state_dict


def _keep_missing_step(original: Callable) -> Callable:
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _sequence_parallel_norm(original: Callable) -> Callable:
    """A torch norm on a sequence-parallel shard: its weights see only this rank's tokens, so they are marked
    ``sequence_parallel`` and finalize_model_grads all-reduces their gradients over the tensor-parallel group
    (what apex's and Transformer Engine's norms do). 0.16.1 asserts instead."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        unsharded = copy.copy(config)  # only to pass the assertion: the norm itself is per token
        unsharded.sequence_parallel = False
        norm = original(cls, unsharded, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__
