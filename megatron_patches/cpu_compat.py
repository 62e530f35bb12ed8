"""CPU compatibility layer: lets megatron.core run on a CPU-only torch build (tests, this project's CI).

Owns every patch this project applies to torch.cuda and megatron.core, listed in ``PATCHES`` below, applied by
``install()`` and undone by ``uninstall()``. It is never active when CUDA is available, and refuses a
megatron-core other than the one it was written against (0.16.x): the call sites it fixes move between releases.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch.overrides import TorchFunctionMode

WRITTEN_FOR_MEGATRON = "0.16."
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
    Patch("torch.cuda.Stream / current_stream / stream / Event", "MoE dispatchers and DDP record work on streams"),
    Patch("moe.moe_utils.te_general_gemm", "0.16.1 references it even when Transformer Engine is absent"),
    Patch("moe.token_dispatcher.maybe_move_tensor_to_cpu", "leaves CPU split sizes as tensors: all_to_all fails"),
    Patch("TorchFunctionMode: device='cuda' / .cuda() / .to('cuda') -> cpu",
          "DDP buffers, the optimizers and the pipeline schedules hard-code 'cuda'"),
    Patch("torch.Tensor.type() reports torch.cuda.*", "DistributedOptimizer and clip_grads check these strings"),
    Patch("transformer.torch_norm.WrappedTorchNorm.__new__: accepts sequence_parallel",
          "the local spec's only norm without apex/TE; MoE with TP>1 requires sequence parallelism"),
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
    state.mode = _CudaToCpuMode()
    state.mode.__enter__()
    _STATE = state
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
