"""Fake CUDA devices, streams and events, and a fake NCCL, to check the CUDA/NCCL contracts of the project on a
CPU-only torch (written against torch 2.13, whose CPU build has no CUDA).

How to use (pytest fixtures in ``tests/gpu_contracts/conftest.py``)::

    def test_something(fake_gpu_rank):           # this process is rank LOCAL_RANK=3 of a node with 8 GPUs
        t = torch.zeros(4, device="cuda")         # on the current device: cuda:0 until someone calls set_device
        torch.cuda.set_device(fake_gpu_rank.device)
        w = torch.randn(4, 4).to("cuda:3")        # reports cuda:3 wherever Python asks (device, is_cuda, get_device)
        (t @ w).sum()                             # real values, computed on the CPU
        torch.randn(4) + w                        # raises "Expected all tensors to be on the same device", as CUDA
        assert fake_gpu_rank.misplaced_work() == []   # no work left the stream the code meant it for

    def test_collectives(fake_nccl):              # fake_gpu_rank + a process group behaving as NCCL: rank 3 of 8
        dist.all_reduce(torch.ones(2))            # raises "No backend type associated with device type cpu"
        dist.all_reduce(torch.ones(2, device="cuda:3"))   # fine ("fake" backend: the tensor is left as it is)

Or without pytest: ``with FakeGpuRank(local_rank=1, device_count=2) as rank: ...`` and ``with FakeNccl(rank): ...``.

:class:`FakeGpuRank` (a device is a tag on a tensor's storage, the data stay on the CPU):
  - ``torch.cuda`` is available with ``device_count`` devices (compute capability 9.0, bf16 supported), the current
    device is 0 until ``set_device`` (as in a fresh process), ``LOCAL_RANK`` is set, and DeepSpeed's accelerator
    is its CUDA one.
  - Tensors made with ``device="cuda[:N]"`` (factories, ``torch.tensor``), by ``.to``/``.cuda()``, or by any op on
    such tensors report that device; ``.to("cpu")``/``.cpu()`` copies to a host tensor. An op mixing two devices
    raises as CUDA does (a 0-dim host tensor is a scalar and allowed); copies across devices are allowed. Autograd
    works (the backward's ops are checked and placed the same way), so gradients of a model on a fake device are on
    it.
  - ``pin_memory=True`` allocations work and report ``is_pinned()``; ``torch.cuda.cudart()`` registers host memory
    (:class:`FakeCudart`, :attr:`FakeGpuRank.cudart`: what is registered, every call). Assigning ``.grad`` checks
    the devices as torch does (autograd itself may leave a gradient on another device than its tensor's data, as on
    CUDA).
  - Streams and events record their device. Every op touching a device tensor is logged as :class:`Work` on the
    stream it runs on as CUDA would run it: the current stream *of the tensor's device*, whichever stream
    ``torch.cuda.stream(s)`` made current (for ``s`` of another device that is not ``s``).
    :meth:`FakeGpuRank.misplaced_work` lists the work issued inside a side stream's context that did not run on it
    (an event recorded on that stream would not cover it); :meth:`FakeGpuRank.unwaited_copies` the copies to host
    memory made on a side stream that no event synchronize (or stream/device synchronize) covered.
  - :attr:`FakeGpuRank.touched` lists every device a tensor, stream, event or piece of work was on (a CUDA context);
    :attr:`FakeGpuRank.allocations` every storage made on a fake GPU (:class:`Allocation`: op, device, bytes,
    shape), :meth:`FakeGpuRank.live_bytes` the bytes of those still alive.
:class:`FakeNccl`: every ``c10d`` collective (``torch.distributed``'s, DeepSpeed's and Megatron's calls all reach
  them) must get tensors on this rank's device, as NCCL: a host tensor raises NCCL's "No backend type associated
  with device type cpu", a tensor on another GPU raises too (one communicator per rank and GPU); a barrier needs the
  current device to be the rank's. ``get_backend`` says ``nccl``, object collectives go through the current device.
  The process group is torch's "fake" backend (``FakeStore``), rank 3 of 8 by default: all_gather gives every rank
  this rank's data, all_reduce leaves the tensor as it is. An existing default process group (another test's) is
  set aside and restored.

What it cannot check: kernels' timing (a wrong stream is reported, never raced), memory limits, NCCL's own
numerics, anything CUDA-only in C++ (DeepSpeed's CUDA ops).
"""
from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CPU = torch.device("cpu")
_DEVICE_TAG = "_fake_cuda_device"  # attribute set on a storage's (preserved) Python object
_PINNED_TAG = "_fake_pinned"
# aten ops that take tensors of two devices on CUDA too
_CROSS_DEVICE = {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy",
                 "aten::set_", "aten::is_pinned", "aten::_pin_memory", "aten::lift_fresh"}


def fake_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` is on under a :class:`FakeGpuRank` (its storage's tag), the CPU when untagged."""
    return getattr(_storage(t), _DEVICE_TAG, None) or CPU


def _storage(t: torch.Tensor):
    return torch._C.TensorBase.untyped_storage(t)


def _tag(t: torch.Tensor, device: torch.device, pinned: bool = False) -> None:
    storage = _storage(t)
    setattr(storage, _DEVICE_TAG, device if device.type == "cuda" else None)
    if pinned:
        setattr(storage, _PINNED_TAG, True)


@dataclasses.dataclass
class Work:
    """One op on a device tensor: ``op``, the device it ran on, the stream it ran on, the stream the code had
    made current when it issued it (``torch.cuda.stream``), and whether it copied device memory to the host."""

    op: str
    device: torch.device
    stream: "FakeStream"
    context: "FakeStream"
    to_host: bool
    waited: bool = False


@dataclasses.dataclass
class Allocation:
    """A storage made on a fake GPU: by ``op``, on ``device``, ``nbytes`` when made, for a tensor of ``shape``."""

    op: str
    device: torch.device
    nbytes: int
    shape: tuple


class FakeCudart:
    """``torch.cuda.cudart()``'s host-memory registration: ``registered`` maps each address registered and not yet
    unregistered to its bytes, ``calls`` lists every call in order; every call succeeds (0, cudaSuccess)."""

    def __init__(self):
        self.registered: Dict[int, int] = {}
        self.calls: List[tuple] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size, flags))
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        del self.registered[address]
        return 0

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is registered (CUDA reports it pinned)."""
        address = _storage(tensor).data_ptr()
        return any(start <= address < start + size for start, size in self.registered.items())


class FakeStream:
    """A CUDA stream of ``device``: the work it ran, in order."""

    def __init__(self, device=None, priority: int = 0, rank: "FakeGpuRank" = None, default: bool = False, **_):
        self.rank = rank or FakeGpuRank.active
        self.device = self.rank.resolve(device)
        self.default = default
        self.works: List[Work] = []
        self.rank.touch(self.device)
        self.rank.streams.append(self)

    def __repr__(self) -> str:
        return f"<fake {'default ' if self.default else ''}stream of {self.device}>"

    def wait_stream(self, other: "FakeStream") -> None:
        self.rank.check_same_kind(other, "wait_stream")

    def wait_event(self, event: "FakeEvent") -> None:
        event.wait(self)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        for work in self.works:
            work.waited = True

    def query(self) -> bool:
        return True


class FakeEvent:
    """A CUDA event: the stream it was recorded on and the work that stream had run by then."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.rank = FakeGpuRank.active
        self.stream: Optional[FakeStream] = None
        self.covers: List[Work] = []
        self.rank.events.append(self)

    @property
    def device(self) -> Optional[torch.device]:
        return None if self.stream is None else self.stream.device

    def record(self, stream: Optional[FakeStream] = None) -> None:
        stream = stream or self.rank.current_stream()
        self.rank.check_same_kind(stream, "Event.record")
        self.stream, self.covers = stream, list(stream.works)
        self.rank.touch(stream.device)

    def synchronize(self) -> None:
        for work in self.covers:
            work.waited = True

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        self.rank.check_same_kind(stream or self.rank.current_stream(), "Event.wait")

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 0.0


class _StreamContext:
    """``torch.cuda.stream(s)``: as torch's StreamContext, makes ``s`` the current stream of its device and its
    device the current one, and restores both."""

    def __init__(self, stream: Optional[FakeStream]):
        self.stream = stream

    def __enter__(self):
        rank = FakeGpuRank.active
        if self.stream is None:
            return None
        self.saved = (rank.current, dict(rank.current_streams))
        rank.current = self.stream.device.index
        rank.current_streams[self.stream.device.index] = self.stream
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            rank = FakeGpuRank.active
            rank.current, rank.current_streams = self.saved
        return False


class _DeviceContext:
    """``torch.cuda.device(d)``: ``d`` current inside, the previous device after."""

    def __init__(self, device):
        self.index = None if device is None else FakeGpuRank.active.resolve(device).index

    def __enter__(self):
        rank = FakeGpuRank.active
        self.saved = rank.current
        if self.index is not None:
            rank.current = self.index
        return self

    def __exit__(self, *exc):
        FakeGpuRank.active.current = self.saved
        return False


class _Mode(TorchDispatchMode):
    """Runs every op on the CPU with the devices replaced, checks that an op does not mix devices, logs its work
    and tags the storages it makes with the device they are on."""

    def __init__(self, rank: "FakeGpuRank"):
        super().__init__()
        self.rank = rank

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name
        target = None
        if kwargs.get("device") is not None:
            target = self.rank.resolve(kwargs["device"])
            kwargs["device"] = CPU
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs["pin_memory"] = False
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if name == "aten::is_pinned":
            return bool(getattr(_storage(args[0]), _PINNED_TAG, False)) or self.rank.cudart.covers(args[0])
        if name == "aten::_pin_memory":
            out = args[0].clone()
            _tag(out, CPU, pinned=True)
            return out
        if func.namespace == "c10d" and self.rank.nccl is not None:
            self.rank.nccl.check(name, tensors)
        devices = [fake_device(t) for t in tensors]
        placed = {d for t, d in zip(tensors, devices) if d.type == "cuda" or t.dim() > 0}
        if len(placed) > 1 and name not in _CROSS_DEVICE and func.namespace != "c10d":
            a, b = sorted(map(str, placed))[:2]
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{a} and {b}! (fake CUDA: {name})")
        out = func(*args, **kwargs)
        inputs = {id(_storage(t)) for t in tensors}
        made = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and id(_storage(o)) not in inputs]
        device = target or next((d for d in devices if d.type == "cuda"), CPU)
        copy = name in ("aten::copy_", "aten::_copy_from")
        for o in made:
            _tag(o, devices[0] if copy else device, pinned)  # a copy's destination keeps its device
            if fake_device(o).type == "cuda":
                self.rank.allocated(name, o)
        if not (made or func._schema.is_mutable):
            return out  # a view or metadata: no kernel runs
        to_host = (copy and devices[0].type == "cpu") or (target is not None and target.type == "cpu")
        for d in {d for d in devices + [target] if d is not None and d.type == "cuda"}:
            self.rank.log(name, d, to_host)
        return out


class FakeGpuRank:
    """This process as local rank ``local_rank`` of a node with ``device_count`` fake GPUs (see the module's
    docstring). A context manager; one at a time (:attr:`active`)."""

    active: Optional["FakeGpuRank"] = None

    def __init__(self, local_rank: int = 3, device_count: int = 8):
        if not 0 <= local_rank < device_count:
            raise ValueError(f"local_rank: got {local_rank}; accepted: 0..{device_count - 1} (device_count)")
        self.local_rank = local_rank
        self.device_count = device_count
        self.device = torch.device("cuda", local_rank)
        self.current = 0  # a fresh process: device 0 until set_device
        self.streams: List[FakeStream] = []
        self.events: List[FakeEvent] = []
        self.works: List[Work] = []
        self.touched: set = set()  # devices a CUDA context was made on
        self.allocations: List[Allocation] = []  # every storage made on a fake GPU, in order
        self._storages: List[weakref.ref] = []
        self.nccl: Optional["FakeNccl"] = None
        self.cudart = FakeCudart()
        self._undo: List[Any] = []
        self.current_streams: Dict[int, FakeStream] = {}
        self._defaults: Dict[int, FakeStream] = {}

    # ----- what torch.cuda answers ---------------------------------------------------------------------------
    def resolve(self, device) -> torch.device:
        """``device`` (str, int, torch.device or None: the current device) as a torch.device with an index."""
        if device is None:
            return torch.device("cuda", self.current)
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.current)
        if device.type == "cuda" and device.index >= self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (fake: cuda:{device.index} of "
                               f"{self.device_count} devices)")
        return device

    def touch(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.touched.add(device)

    def default_stream(self, device=None) -> FakeStream:
        index = self.resolve(device).index
        if index not in self._defaults:
            self._defaults[index] = FakeStream(torch.device("cuda", index), rank=self, default=True)
        return self._defaults[index]

    def current_stream(self, device=None) -> FakeStream:
        index = self.resolve(device).index
        return self.current_streams.get(index) or self.default_stream(index)

    def set_stream(self, stream: FakeStream) -> None:
        self.current = stream.device.index
        self.current_streams[stream.device.index] = stream

    def set_device(self, device) -> None:
        self.current = self.resolve(device).index

    def check_same_kind(self, stream, what: str) -> None:
        if not isinstance(stream, FakeStream):
            raise TypeError(f"{what}: got {type(stream).__name__}; a torch.cuda stream was expected")

    def allocated(self, op: str, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        self.allocations.append(Allocation(op, fake_device(tensor), storage.nbytes(), tuple(tensor.shape)))
        self._storages.append(weakref.ref(storage))

    def log(self, op: str, device: torch.device, to_host: bool) -> None:
        self.touch(device)
        context = self.current_stream()
        self.works.append(Work(op, device, self.current_stream(device), context, to_host))
        self.works[-1].stream.works.append(self.works[-1])

    # ----- what tests read -----------------------------------------------------------------------------------
    def live_bytes(self, device=None) -> int:
        """Bytes of the storages on ``device`` (every fake GPU when None) still alive now (a storage resized to 0
        counts 0)."""
        alive = [ref() for ref in self._storages]
        return sum(s.nbytes() for s in alive
                   if s is not None and (device is None or getattr(s, _DEVICE_TAG, None) == self.resolve(device)))

    def misplaced_work(self) -> List[Work]:
        """Work issued while a side stream was current (``torch.cuda.stream(s)``) that ran on another stream: an
        event recorded on ``s`` does not cover it, so waiting for that event does not wait for it."""
        return [w for w in self.works if not w.context.default and w.stream is not w.context]

    def unwaited_copies(self) -> List[Work]:
        """Copies to host memory issued on a side stream that no synchronize covered: the host may read them
        before they are done."""
        return [w for w in self.works if w.to_host and not w.stream.default and not w.waited]

    # ----- install / remove ----------------------------------------------------------------------------------
    def _patch(self, owner, name: str, value) -> None:
        missing = object()
        old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
        self._undo.append((owner, name, old, missing))
        setattr(owner, name, value)

    def __enter__(self) -> "FakeGpuRank":
        if FakeGpuRank.active is not None:
            raise RuntimeError("a FakeGpuRank is already active")
        FakeGpuRank.active = self
        cuda = torch.cuda
        rank = self
        self._env = os.environ.get("LOCAL_RANK")
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        for name, value in {
            "is_available": lambda: True, "device_count": lambda: self.device_count,
            "current_device": lambda: self.current, "set_device": self.set_device,
            "_lazy_init": lambda: None, "is_initialized": lambda: True, "init": lambda: None,
            "Stream": FakeStream, "Event": FakeEvent, "stream": _StreamContext, "device": _DeviceContext,
            "current_stream": self.current_stream, "default_stream": self.default_stream,
            "set_stream": self.set_stream, "synchronize": self._synchronize,
            "is_bf16_supported": lambda *a, **k: True, "cudart": lambda: self.cudart,
            "get_device_capability": lambda device=None: (9, 0), "get_device_name": lambda device=None: "fake GPU",
        }.items():
            self._patch(cuda, name, value)

        def to(tensor, *args, copy=False, **kwargs):
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            options = dict(dtype=dtype, non_blocking=non_blocking, copy=copy)
            if memory_format is not None:
                options["memory_format"] = memory_format
            if device is None or rank.resolve(device) == fake_device(tensor):
                return _ORIGINAL_TO(tensor, **options)
            # a copy on the CPU (C++ sees two host tensors), which the mode tags with the target device
            return _ORIGINAL_TO(tensor, rank.resolve(device), **dict(options, copy=True))

        def from_data(make):
            def made(data, *args, device=None, **kwargs):  # torch.tensor allocates out of the dispatcher's sight
                out = make(data, *args, **kwargs)
                return out if device is None else out.to(rank.resolve(device))
            return made

        self._patch(torch, "tensor", from_data(torch.tensor))
        self._patch(torch, "as_tensor", from_data(torch.as_tensor))
        self._patch(torch.Tensor, "to", to)
        self._patch(torch.Tensor, "cpu", lambda t, *a, **k: t.to(CPU))
        self._patch(torch.Tensor, "cuda", lambda t, device=None, non_blocking=False, **k:
                    t.to(rank.resolve(device), non_blocking=non_blocking))
        self._patch(torch.Tensor, "device", property(fake_device))
        self._patch(torch.Tensor, "is_cuda", property(lambda t: fake_device(t).type == "cuda"))
        self._patch(torch.Tensor, "get_device", lambda t: fake_device(t).index if fake_device(t).type == "cuda"
                    else -1)
        self._patch(torch.Tensor, "record_stream", lambda t, stream: self._record_stream(t, stream))
        self._patch(torch.Tensor, "grad", property(_BASE_GRAD.__get__, _set_grad))
        try:
            from deepspeed.accelerator import real_accelerator
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
        except ImportError:  # DeepSpeed is optional for this harness
            real_accelerator = None
        if real_accelerator is not None:
            self._patch(real_accelerator, "ds_accelerator", CUDA_Accelerator())
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._mode.__exit__(*exc)
        for owner, name, old, missing in reversed(self._undo):
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo = []
        if self._env is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = self._env
        FakeGpuRank.active = None
        return False

    def _synchronize(self, device=None) -> None:
        for stream in self.streams:
            if stream.device == self.resolve(device):
                stream.synchronize()

    def _record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        if fake_device(tensor) != stream.device:
            raise RuntimeError(f"record_stream: a tensor on {fake_device(tensor)} recorded on a stream of "
                               f"{stream.device} (fake CUDA)")


_ORIGINAL_TO = torch.Tensor.to
_BASE_GRAD = torch._C.TensorBase.grad


def _set_grad(tensor: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``tensor.grad = grad`` with torch's check of the devices (C++, which sees two host tensors here)."""
    if grad is not None and fake_device(grad) != fake_device(tensor):
        raise RuntimeError(f"attempting to assign a gradient located on device {fake_device(grad)} to a tensor on "
                           f"{fake_device(tensor)}; please ensure that the gradient and the tensor are on the same "
                           f"device (fake CUDA)")
    _BASE_GRAD.__set__(tensor, grad)
# c10d's process-group state (torch 2.13): the world object, the maps its properties read, the group counter (kept
# counting while the fake group lives, so that no group name is taken twice)
_C10D_STATE = ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag",
               "_group_count")


class FakeNccl:
    """Collectives as NCCL takes them, for the :class:`FakeGpuRank` ``rank`` (see the module's docstring).
    ``calls`` lists ``(op, devices of its tensors)`` of every collective that passed."""

    def __init__(self, rank: FakeGpuRank, group_rank: int = 3, world_size: int = 8):
        self.rank = rank
        self.group_rank, self.world_size = group_rank, world_size
        self.calls: List[tuple] = []
        self._undo: List[tuple] = []

    def check(self, op: str, tensors: List[torch.Tensor]) -> None:
        if op == "c10d::barrier":
            if self.rank.current != self.rank.local_rank:
                raise RuntimeError(f"NCCL barrier on cuda:{self.rank.current}, the current device; this rank's GPU "
                                   f"is {self.rank.device}: set the device first (fake NCCL)")
            self.calls.append((op, [self.rank.resolve(None)]))
            return
        devices = [fake_device(t) for t in tensors]
        for device in devices:
            if device.type != "cuda":
                raise RuntimeError(f"No backend type associated with device type {device.type} (fake NCCL: {op})")
            if device != self.rank.device:
                raise RuntimeError(f"NCCL: a tensor on {device}; this rank's communicator is on {self.rank.device} "
                                   f"(fake NCCL: {op})")
        self.calls.append((op, devices))

    def __enter__(self) -> "FakeNccl":
        import torch.cuda.nccl
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # another test's default group, set aside: torch 2.13 keeps c10d's state in the world object and the
        # module globals its properties read
        self._saved = {name: getattr(c10d, name) for name in _C10D_STATE}
        c10d._world = c10d._World()
        for name in _C10D_STATE[1:-1]:
            setattr(c10d, name, {})
        dist.init_process_group("fake", store=FakeStore(), rank=self.group_rank, world_size=self.world_size)
        for owner, name, value in ((dist, "get_backend", lambda group=None: "nccl"),
                                   (c10d, "get_backend", lambda group=None: "nccl"),
                                   (c10d, "_get_object_coll_device", lambda group=None: "cuda"),
                                   (torch.cuda.nccl, "version", lambda: (2, 0, 0))):  # c10d's logger, on a failure
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        self.rank.nccl = self
        return self

    def __exit__(self, *exc) -> bool:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.rank.nccl = None
        dist.destroy_process_group()  # unregisters every group, those set aside too: registered again below
        for owner, name, old in reversed(self._undo):
            setattr(owner, name, old)
        self._undo = []
        for name, value in self._saved.items():
            setattr(c10d, name, value)
        for group, name in c10d._world.pg_names.items():
            c10d._register_process_group(name, group)
        default = c10d._world.default_pg
        torch._C._distributed_c10d._set_global_rank(default.rank() if default is not None else -1)
        return False
