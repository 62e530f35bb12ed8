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
    is its own CUDA one over the fake devices (:func:`fake_cuda_accelerator`): DeepSpeed's engine runs on them.
  - Tensors made with ``device="cuda[:N]"`` or ``device=N`` (factories, ``torch.tensor``), by ``.to``/``.cuda()``,
    or by any op on such tensors report that device; ``.to("cpu")``/``.cpu()`` copies to a host tensor; meta tensors
    stay meta. An op mixing two devices raises as CUDA does; a host tensor is taken beside device tensors only
    where CUDA takes one (a 0-dim input of a pointwise op, ``fill_``, ``masked_fill``, ``_foreach_`` ops and
    indexing, whose indices may be on the host); copies across devices are allowed. Autograd works (the backward's
    ops are checked and placed the same way), so gradients of a model on a fake device are on it. Random ops on a
    fake GPU draw from its own generator (``torch.cuda.manual_seed``), not the CPU's.
  - ``pin_memory=True`` allocations work and report ``is_pinned()``; ``torch.cuda.cudart()`` registers host memory
    (:class:`FakeCudart`, :attr:`FakeGpuRank.cudart`: what is registered, every call). Assigning ``.grad`` checks
    the devices as torch does (autograd itself may leave a gradient on another device than its tensor's data, as on
    CUDA). ``tensor.type()`` names a fake GPU tensor's CUDA type.
  - Streams and events record their device. Every op touching a device tensor is logged as :class:`Work` on the
    stream it runs on as CUDA would run it: the current stream *of the tensor's device*, whichever stream
    ``torch.cuda.stream(s)`` made current (for ``s`` of another device that is not ``s``).
    :meth:`FakeGpuRank.misplaced_work` lists the work issued inside a side stream's context that did not run on it
    (an event recorded on that stream would not cover it); :meth:`FakeGpuRank.unwaited_copies` the copies to host
    memory made on a side stream that no event synchronize (or stream/device synchronize) covered.
  - Stream order: each write to a storage's bytes is kept with its stream; an op on another stream, or the host
    (an op on a host tensor, ``tolist``, ``numpy``, ``.item()``, DeepSpeed's CPU Adam kernel), that reads or writes
    them before a wait covers that write raises ``fake CUDA stream order: ...``. A stream's wait covers what it
    waited for (``wait_stream``, ``wait_event``: transitively); the host's (an event's or stream's ``synchronize``,
    ``torch.cuda.synchronize``, a blocking copy to the host) covers every stream's later work. A device block freed
    while another stream used it, neither recorded (``record_stream``) nor waited for, is listed in
    :attr:`FakeGpuRank.unsafe_frees`; leaving the context raises for it.
  - :attr:`FakeGpuRank.touched` lists every device a tensor, stream, event or piece of work was on (a CUDA context);
    :attr:`FakeGpuRank.allocations` every storage made on a fake GPU (:class:`Allocation`: op, device, bytes,
    shape), :meth:`FakeGpuRank.live_bytes` the bytes of those still alive.
:class:`FakeNccl`: every ``c10d`` collective (``torch.distributed``'s, DeepSpeed's and Megatron's calls all reach
  them) must get tensors on this rank's device, as NCCL: a host tensor raises NCCL's "No backend type associated
  with device type cpu", a tensor on another GPU raises too (one communicator per rank and GPU); a barrier needs the
  current device to be the rank's. ``get_backend`` says ``nccl``, object collectives go through the current device.
  The process group is torch's "fake" backend (``FakeStore``), rank 3 of 8 by default: all_gather gives every rank
  this rank's data, all_reduce leaves the tensor as it is, a broadcast leaves each rank its own. A group made for
  gloo (``new_group(backend="gloo")``) takes host tensors unchecked. An existing default process group (another
  test's) and DeepSpeed's cached groups are set aside and restored. :attr:`FakeNccl.sites` keeps the lines of the
  project's code that issued a collective.

What it cannot check: kernels' timing (a race is reported, never run), a buffer overwritten while a stream still
reads it, memory limits, NCCL's own numerics and data movement, anything CUDA-only in C++ (DeepSpeed's CUDA ops).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CPU = torch.device("cpu")
_BASE_DEVICE = torch._C.TensorBase.device
_PROCESS_GROUP = torch._C._distributed_c10d.ProcessGroup if torch.distributed.is_available() else ()
_DEVICE_TAG = "_fake_cuda_device"  # attribute set on a storage's (preserved) Python object
_PINNED_TAG = "_fake_pinned"
_WRITES_TAG = "_fake_writes"  # the writes by streams a reader must wait for (``_Write``)
_LIFE_TAG = "_fake_life"  # a device storage's streams (``_Lifetime``)
# aten ops that take tensors of two devices on CUDA too
_CROSS_DEVICE = {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy",
                 "aten::set_", "aten::is_pinned", "aten::_pin_memory", "aten::lift_fresh"}


def fake_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` is on under a :class:`FakeGpuRank`: its storage's tag, the CPU when untagged; a tensor on
    another device than the CPU (``meta``) is where it is."""
    real = _BASE_DEVICE.__get__(t)
    if real.type != "cpu":
        return real
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
class _Write:
    """A write to bytes ``start``..``end`` of a storage by work number ``index`` of ``stream``."""

    start: int
    end: int
    stream: "FakeStream"
    index: int
    op: str


@dataclasses.dataclass
class _Lifetime:
    """A device storage's block: the op and stream that made it, the other streams that used it (id -> (stream, index
    of the last work that did)), those it was recorded on (``record_stream``), and whether it was freed (its storage
    resized to 0 frees it; resized up again, it is a new block of the then current stream)."""

    op: str
    shape: tuple
    stream: "FakeStream"
    uses: Dict[int, tuple] = dataclasses.field(default_factory=dict)
    recorded: set = dataclasses.field(default_factory=set)
    freed: bool = False


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


def _merge_waits(waited: Dict[int, int], stream: "FakeStream", count: int, its_waits: Dict[int, int]) -> None:
    """``waited`` (a stream's or the host's) now covers ``stream``'s first ``count`` works and, transitively, what
    ``stream`` had waited for by then (``its_waits``), as CUDA orders them."""
    for key, value in its_waits.items():
        waited[key] = max(waited.get(key, 0), value)
    waited[id(stream)] = max(waited.get(id(stream), 0), count)


class _Host:
    """The host thread as a waiter: the work of each stream it has waited for (a synchronize, a blocking copy)."""

    def __init__(self):
        self.waited: Dict[int, int] = {}

    def __repr__(self) -> str:
        return "the host"


class FakeStream:
    """A CUDA stream of ``device``: the work it ran, in order, and what of the other streams' work it waited for
    (``waited``: id of a stream -> how many of its works)."""

    def __init__(self, device=None, priority: int = 0, rank: "FakeGpuRank" = None, default: bool = False, **_):
        self.rank = rank or FakeGpuRank.active
        self.device = self.rank.resolve(device)
        self.default = default
        self.works: List[Work] = []
        self.waited: Dict[int, int] = {}
        self.rank.touch(self.device)
        self.rank.streams.append(self)

    def __repr__(self) -> str:
        return f"<fake {'default ' if self.default else ''}stream of {self.device}>"

    @property
    def count(self) -> int:
        return len(self.works)

    def wait_stream(self, other: "FakeStream") -> None:
        self.rank.check_same_kind(other, "wait_stream")
        _merge_waits(self.waited, other, other.count, other.waited)

    def wait_event(self, event: "FakeEvent") -> None:
        event.wait(self)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        for work in self.works:
            work.waited = True
        _merge_waits(self.rank.host.waited, self, self.count, self.waited)

    def query(self) -> bool:
        return True


class FakeEvent:
    """A CUDA event: the stream it was recorded on, the work that stream had run by then and what it had waited
    for; waiting for it (a stream, or the host by ``synchronize``) covers all of that. An event never recorded
    covers nothing."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.rank = FakeGpuRank.active
        self.stream: Optional[FakeStream] = None
        self.covers: List[Work] = []
        self.count, self.stream_waits = 0, {}
        self.rank.events.append(self)

    @property
    def device(self) -> Optional[torch.device]:
        return None if self.stream is None else self.stream.device

    def record(self, stream: Optional[FakeStream] = None) -> None:
        stream = stream or self.rank.current_stream()
        self.rank.check_same_kind(stream, "Event.record")
        self.stream, self.covers = stream, list(stream.works)
        self.count, self.stream_waits = stream.count, dict(stream.waited)
        self.rank.touch(stream.device)

    def synchronize(self) -> None:
        for work in self.covers:
            work.waited = True
        if self.stream is not None:
            _merge_waits(self.rank.host.waited, self.stream, self.count, self.stream_waits)

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        stream = stream or self.rank.current_stream()
        self.rank.check_same_kind(stream, "Event.wait")
        if self.stream is not None:
            _merge_waits(stream.waited, self.stream, self.count, self.stream_waits)

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


def _byte_range(t: torch.Tensor) -> tuple:
    """The bytes of its storage that ``t`` (a view of it) spans, from its first element to its last."""
    size = t.element_size()
    if t.numel() == 0:
        return 0, 0
    first = t.storage_offset() * size
    return first, first + (sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1) * size


def _written_args(func, args, kwargs) -> List[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments: ``self`` of ``add_``, ``out``)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or index >= len(args) else args[index]
        written += [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    return written


# Ops that take a 0-dim host tensor beside device tensors on CUDA, besides the pointwise ones (TensorIterator's CPU
# scalar): they read its value on the host (fill_, masked_fill_'s value) or have a scalar-tensor overload that does
# (_foreach_*). Everything else (stack, cat, matmul, reductions, collectives) refuses it.
_HOST_SCALAR_OPS = ("aten::fill_", "aten::masked_fill_", "aten::masked_fill", "aten::_foreach_")
# Advanced indexing takes its indices on the host, of any shape, and moves them to the device
# (at::native::index / index_put_), and a 0-dim host value, moved too (``t[mask] = 0`` makes one: torch makes the
# value of a Python scalar on the device of ``t``, which here is the CPU)
_INDEX_OPS = ("aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_")
_COPIES = ("aten::copy_", "aten::_copy_from")
# In-place ops that change a tensor's metadata only (which storage, shape, strides): no kernel reads or writes data
_METADATA_OPS = {"aten::set_", "aten::resize_", "aten::as_strided_", "aten::squeeze_", "aten::unsqueeze_",
                 "aten::t_", "aten::transpose_", "aten::swapdims_", "aten::swapaxes_", "aten::detach_"}


def _allowed_on_host(func, name: str, args, written: List[torch.Tensor]) -> List[torch.Tensor]:
    """The operands of ``func`` that CUDA takes on the host beside device tensors: the indices of an indexing op,
    and 0-dim inputs never written (CUDA refuses an in-place op on a host tensor with a device operand: the output
    decides the device) of a pointwise op, an indexing op or one of ``_HOST_SCALAR_OPS``."""
    allowed = []
    if name in _INDEX_OPS and len(args) > 1:
        allowed += [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
    if torch.Tag.pointwise in func.tags or name.startswith(_HOST_SCALAR_OPS) or name in _INDEX_OPS:
        allowed += [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.dim() == 0
                    and not any(t is w for w in written)]
    return allowed


def _casting_a_gradient_back() -> bool:
    """Inside the backward of a dtype or device cast (``ToCopyBackward0``), which calls ``aten::_to_copy`` with the
    forward input's options."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name().startswith("ToCopyBackward")


class _Mode(TorchDispatchMode):
    """Runs every op on the CPU with the devices replaced, checks that an op does not mix devices and that it reads
    and writes nothing another stream (or the host) may still be writing, logs its work and tags the storages it
    makes with the device they are on."""

    def __init__(self, rank: "FakeGpuRank"):
        super().__init__()
        self.rank = rank

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name
        target = self._target_device(name, args, kwargs)
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs["pin_memory"] = False
        flat = tree_flatten((args, kwargs))[0]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if name == "aten::is_pinned":
            return _is_pinned(args[0])
        if name == "aten::_pin_memory":
            out = args[0].clone()
            _tag(out, CPU, pinned=True)
            return out
        if func.namespace == "c10d" and self.rank.nccl is not None:
            group = next((a for a in flat if isinstance(a, _PROCESS_GROUP)), None)
            self.rank.nccl.check(name, tensors, group)
        devices = [fake_device(t) for t in tensors]
        written = _written_args(func, args, kwargs)
        _check_one_device(func, name, args, tensors, devices, written)
        device = target if target is not None and target.type == "cuda" else \
            next((d for d in devices if d.type == "cuda"), None)
        mutable = func._schema.is_mutable and name not in _METADATA_OPS
        if mutable:  # checked before it writes anything
            self.rank.ordered(name, tensors, written, device)
        out = self._run(func, args, kwargs, device)
        inputs = {id(_storage(t)) for t in tensors}
        made = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and id(_storage(o)) not in inputs]
        copy = name in _COPIES
        d2h = device is not None and ((copy and devices[0].type == "cpu") or (target is not None and target.type
                                                                                == "cpu"))
        # torch's _to_copy gives a non-blocking copy to the host pinned memory (at::native::_to_copy, pin_out)
        pinned = pinned or (d2h and name == "aten::_to_copy" and bool(kwargs.get("non_blocking")))
        for o in made:
            _tag(o, devices[0] if copy else (target or device or CPU), pinned)  # a copy's destination keeps its device
            if fake_device(o).type == "cuda":
                self.rank.allocated(name, o)
        if name == "aten::_local_scalar_dense":  # .item(): a copy to the host on the current stream, waited for
            self.rank.host_read(tensors[0], name)
            return out
        if not (made or mutable):
            return out  # a view or metadata: no kernel runs
        if not mutable:
            self.rank.ordered(name, tensors, made, device)
        if device is None:
            return out
        self.rank.log(name, device, d2h)
        self.rank.wrote([*written, *made], device)
        if d2h:
            self._copied_to_host(args[0] if copy else made[0], args, kwargs, copy, device)
        return out

    def _target_device(self, name: str, args, kwargs: dict) -> Optional[torch.device]:
        """The device an op makes its output on (its ``device`` argument; None without one), with ``kwargs``'s
        ``device`` replaced by the CPU where it names a fake GPU: made on the CPU and tagged afterwards."""
        if kwargs.get("device") is None:
            return None
        target = self.rank.resolve(kwargs["device"])
        if target.type == "cpu" and name == "aten::_to_copy" and _casting_a_gradient_back():
            # autograd casts a gradient back with the forward input's own options, whose device is the host
            # here (a fake GPU tensor is a CPU tensor); on CUDA it is the GPU the gradient is on
            target = fake_device(args[0])
        if target.type == "cuda":  # made on the CPU and tagged; the CPU and meta are what they are
            kwargs["device"] = CPU
        return target

    def _run(self, func, args, kwargs: dict, device: Optional[torch.device]):
        """``func`` run on the CPU; a random op on a fake GPU draws from that device's generator."""
        if device is not None and torch.Tag.nondeterministic_seeded in func.tags:
            with self.rank.device_random(device):  # CUDA's generator of that device, not the CPU's
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _copied_to_host(self, destination: torch.Tensor, args, kwargs: dict, copy: bool,
                        device: torch.device) -> None:
        """A copy from ``device`` to the host into ``destination`` was issued: unless it is a non-blocking copy into
        pinned memory, the host waits for the current stream of ``device``."""
        non_blocking = bool(args[2] if copy and len(args) > 2 else kwargs.get("non_blocking"))
        if not (non_blocking and _is_pinned(destination)):  # a blocking copy: the host waits for the stream
            stream = self.rank.current_stream(device)
            _merge_waits(self.rank.host.waited, stream, stream.count, stream.waited)


def _check_one_device(func, name: str, args, tensors: List[torch.Tensor], devices: List[torch.device],
                      written: List[torch.Tensor]) -> None:
    """Raise as CUDA does when op ``name`` mixes ``tensors`` of two devices (``devices``, theirs), but for the host
    operands CUDA takes beside device tensors, ops that copy across devices and collectives."""
    host_operands = _allowed_on_host(func, name, args, written)
    placed = {d for t, d in zip(tensors, devices)
              if not (d.type == "cpu" and any(t is h for h in host_operands))}
    if len(placed) > 1 and name not in _CROSS_DEVICE and func.namespace != "c10d":
        a, b = sorted(map(str, placed))[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{a} and {b}! (fake CUDA: {name})")


class _IndexDevices(TorchFunctionMode):
    """``device=N`` (an int, as ``torch.cuda.current_device()`` returns) read as ``cuda:N``, as a CUDA build does:
    a CPU-only torch refuses an index before any dispatch ("Cannot access accelerator device")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, int) and not isinstance(device, bool):
            kwargs = dict(kwargs, device=torch.device("cuda", device))
        return func(*args, **kwargs)


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
        self.generators = tuple(torch.Generator() for _ in range(device_count))  # CPU ones standing for CUDA's
        self.total_memory = 80 * 2**30  # what DeepSpeed's accelerator reports for each fake GPU
        self.host = _Host()
        self.unsafe_frees: List[str] = []  # device memory freed while another stream may still use it
        self._open = False

    def generator(self, device=None) -> torch.Generator:
        """The random generator of ``device`` (the current one when None)."""
        return self.generators[self.resolve(device).index]

    @contextlib.contextmanager
    def device_random(self, device: torch.device):
        """Random ops on ``device`` draw from its generator, as CUDA's do, and leave the CPU's as it was."""
        generator, saved = self.generator(device), torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)

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
        storage, device = _storage(tensor), fake_device(tensor)
        self.allocations.append(Allocation(op, device, storage.nbytes(), tuple(tensor.shape)))
        life = _Lifetime(op, tuple(tensor.shape), self.current_stream(device))
        setattr(storage, _LIFE_TAG, life)
        self._storages.append(weakref.ref(storage, lambda _, life=life: self._freed(life)))

    def _freed(self, life: "_Lifetime") -> None:
        """CUDA's caching allocator gives a freed block back to the stream it was allocated on, whose next
        allocations reuse it at once: every other stream that used it must have been recorded on it
        (``record_stream``) or waited for, by that stream or the host, before it was freed."""
        if not self._open or life.freed:
            return
        life.freed = True
        for stream, index in life.uses.values():
            if id(stream) in life.recorded or max(life.stream.waited.get(id(stream), 0),
                                                  self.host.waited.get(id(stream), 0)) >= index:
                continue
            self.unsafe_frees.append(f"a tensor of shape {life.shape} made by {life.op} on {life.stream}, used on "
                                     f"{stream} and freed before that use was waited for or recorded "
                                     f"(record_stream)")

    def _resize_storage(self, storage, nbytes: int):
        """``UntypedStorage.resize_``: to 0 frees a device storage's block (as CUDA's caching allocator frees it), up
        from 0 allocates a new one on the current stream of its device."""
        life, before = getattr(storage, _LIFE_TAG, None), storage.nbytes()
        if life is not None and before and not nbytes:
            self._freed(life)
        result = _ORIGINAL_RESIZE(storage, nbytes)
        if life is not None and nbytes and not before:
            life.stream, life.freed = self.current_stream(getattr(storage, _DEVICE_TAG)), False
            life.uses.clear()
            life.recorded.clear()
        return result

    def ordered(self, op: str, tensors: List[torch.Tensor], written: List[torch.Tensor],
                device: Optional[torch.device]) -> None:
        """Check that ``op``, which reads ``tensors`` and writes ``written`` on the current stream of ``device``
        (on the host when None), runs after every write to them by another stream (or a copy to the host) that it
        must see: waited for by its stream (``wait_stream``, ``wait_event`` of an event recorded after the write)
        or by the host before it issued the op (a synchronize, a blocking copy); raises as the race it would be
        otherwise. A host write
        replaces what it overwrites."""
        reader = self.host if device is None else self.current_stream(device)
        index = None if device is None else reader.count + 1  # the work this op is about to be
        seen = set()
        for t in [*tensors, *written]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            storage = _storage(t)
            first, last = _byte_range(t)
            for write in getattr(storage, _WRITES_TAG, ()):
                if write.stream is reader or write.end <= first or last <= write.start:
                    continue
                # work issued now also follows whatever the host has seen complete (a synchronize)
                if max(reader.waited.get(id(write.stream), 0), self.host.waited.get(id(write.stream), 0)) \
                        < write.index:
                    raise RuntimeError(f"fake CUDA stream order: {op} on {reader} uses a tensor of shape "
                                       f"{tuple(t.shape)} that {write.op} on {write.stream} writes, and nothing "
                                       f"made {reader} wait for that write (wait_stream, wait_event, an event's "
                                       f"synchronize)")
            life = getattr(storage, _LIFE_TAG, None)
            if index is not None and life is not None and reader is not life.stream:
                life.uses[id(reader)] = (reader, index)
        if device is None:
            for t in written:
                self._forget_writes(t)

    def wrote(self, tensors: List[torch.Tensor], device: torch.device) -> None:
        """``tensors`` were just written by the last work of the current stream of ``device``."""
        stream = self.current_stream(device)
        for t in tensors:
            first, last = _byte_range(t)
            self._forget_writes(t)
            storage = _storage(t)
            writes = getattr(storage, _WRITES_TAG, None)
            if writes is None:
                writes = []
                setattr(storage, _WRITES_TAG, writes)
            writes.append(_Write(first, last, stream, stream.count, stream.works[-1].op))

    def _forget_writes(self, t: torch.Tensor) -> None:
        """Drop the writes ``t``'s bytes cover entirely (overwritten since)."""
        writes = getattr(_storage(t), _WRITES_TAG, None)
        if writes:
            first, last = _byte_range(t)
            writes[:] = [w for w in writes if not (first <= w.start and w.end <= last)]

    def host_read(self, tensor: torch.Tensor, what: str) -> None:
        """The host reads ``tensor`` outside torch's dispatcher (``tolist``, ``numpy``, a C++ kernel): a device
        tensor is copied on the current stream and waited for; a host one must not be written by a copy nothing
        waited for."""
        device = fake_device(tensor)
        if device.type != "cuda":
            self.ordered(what, [tensor], [], None)
            return
        self.ordered(what, [tensor], [], device)
        self.log(what, device, True)  # the copy to the host is work of the stream, which the host then waits for
        stream = self.current_stream(device)
        _merge_waits(self.host.waited, stream, stream.count, stream.waited)

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
        self._env = os.environ.get("LOCAL_RANK")
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        for name, value in _fake_torch_cuda(self).items():
            self._patch(torch.cuda, name, value)
        for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed", "initial_seed"):
            # called there too (Megatron's RNG tracker)
            self._patch(torch.cuda.random, name, getattr(torch.cuda, name))
        _patch_tensor_devices(self)
        try:
            from deepspeed.accelerator import real_accelerator
        except ImportError:  # DeepSpeed is optional for this harness
            real_accelerator = None
        if real_accelerator is not None:
            self._patch(real_accelerator, "ds_accelerator", fake_cuda_accelerator(self))
        for method in ("tolist", "numpy"):  # the host reads the data in C++, out of the dispatcher's sight
            self._patch(torch.Tensor, method, _read_on_host(getattr(torch.Tensor, method), method))
        _patch_cpu_adam(self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._index_devices = _IndexDevices()
        self._index_devices.__enter__()
        self._open = True
        return self

    def __exit__(self, *exc) -> bool:
        gc.collect()  # what a cycle still holds is freed while the frees are checked
        self._open = False
        self._index_devices.__exit__(*exc)
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
        if self.unsafe_frees and exc[0] is None:
            raise RuntimeError("fake CUDA: device memory freed while another stream may still use it:\n  "
                               + "\n  ".join(self.unsafe_frees))
        return False

    def _synchronize(self, device=None) -> None:
        for stream in self.streams:
            if stream.device == self.resolve(device):
                stream.synchronize()

    def _record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        if fake_device(tensor) != stream.device:
            raise RuntimeError(f"record_stream: a tensor on {fake_device(tensor)} recorded on a stream of "
                               f"{stream.device} (fake CUDA)")
        life = getattr(_storage(tensor), _LIFE_TAG, None)
        if life is not None:
            life.recorded.add(id(stream))


def _is_pinned(t: torch.Tensor) -> bool:
    return bool(getattr(_storage(t), _PINNED_TAG, False)) or FakeGpuRank.active.cudart.covers(t)


def _read_on_host(method, name: str):
    def read(tensor, *args, **kwargs):
        FakeGpuRank.active.host_read(tensor, f"Tensor.{name}")
        return method(tensor, *args, **kwargs)
    return read


class _HostKernel:
    """A C++ op module whose functions read and write host tensors out of the dispatcher's sight (DeepSpeed's CPU
    Adam): each call is checked as the host reading and writing its tensor arguments."""

    def __init__(self, module, rank: "FakeGpuRank", name: str):
        self._module, self._rank, self._name = module, rank, name

    def __getattr__(self, attribute: str):
        value = getattr(self._module, attribute)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self._rank.ordered(f"{self._name}.{attribute}", tensors, tensors, None)
            return value(*args, **kwargs)
        return call


def _patch_cpu_adam(rank: "FakeGpuRank") -> None:
    """DeepSpeed's CPU Adam (0.19.8: ``DeepSpeedCPUAdam.ds_opt_adam``, the op module its kernels are called through)
    and the host step's GIL-free binding of the same kernel (``offload.kernel.GilFreeCPUAdam``) checked as host
    kernels."""
    from ds_pseudo_real.offload.kernel import GilFreeCPUAdam
    try:
        from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
    except ImportError:
        return
    for cls, name in ((DeepSpeedCPUAdam, "cpu_adam"), (GilFreeCPUAdam, "gil_free_cpu_adam")):
        rank._patch(cls, "__init__", _checked_kernel_init(cls.__init__, rank, name))


def _checked_kernel_init(init, rank: "FakeGpuRank", name: str):
    def checked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.ds_opt_adam = _HostKernel(self.ds_opt_adam, rank, name)
    return checked_init


def fake_cuda_accelerator(rank: "FakeGpuRank"):
    """DeepSpeed's own CUDA accelerator (deepspeed 0.19.8 ``CUDA_Accelerator``) over ``rank``'s fake devices: every
    method is DeepSpeed's, which reaches ``torch.cuda`` (faked), except what needs the CUDA runtime in C++ and only
    describes or tunes a run: NVTX ranges (profiling markers: nothing), the caching allocator's statistics (the fake
    GPUs' live bytes, :meth:`FakeGpuRank.live_bytes`; ``empty_cache`` frees nothing), and the device's total memory
    (:attr:`FakeGpuRank.total_memory`). Its op builders
    are DeepSpeed's CUDA ones, which need nvcc: configs under the fakes use ``torch_adam``."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    class FakeCudaAccelerator(CUDA_Accelerator):
        def range_push(self, msg, domain=None, category=None):
            return None

        def range_pop(self, domain=None):
            return None

        def memory_allocated(self, device_index=None):
            return rank.live_bytes(device_index)

        max_memory_allocated = memory_allocated
        memory_reserved = memory_allocated
        max_memory_reserved = memory_allocated
        memory_cached = memory_allocated
        max_memory_cached = memory_allocated

        def memory_stats(self, device_index=None):
            return {"allocated_bytes.all.current": rank.live_bytes(device_index)}

        def reset_peak_memory_stats(self, device_index=None):
            return None

        reset_max_memory_allocated = reset_peak_memory_stats
        reset_max_memory_cached = reset_peak_memory_stats

        def empty_cache(self):
            return None

        def total_memory(self, device_index=None):
            return rank.total_memory

        def available_memory(self, device_index=None):
            return rank.total_memory - rank.live_bytes(device_index)

    return FakeCudaAccelerator()


_ORIGINAL_TO = torch.Tensor.to
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_ORIGINAL_TYPE = torch.Tensor.type


def _fake_type(tensor: torch.Tensor, dtype=None, non_blocking: bool = False, **kwargs):
    """``tensor.type()`` names a fake GPU tensor's type as CUDA does (``torch.cuda.FloatTensor``; Megatron's
    distributed optimizer checks it); with a type it converts as torch does."""
    if dtype is not None or kwargs:
        return _ORIGINAL_TYPE(tensor, dtype, non_blocking, **kwargs)
    name = _ORIGINAL_TYPE(tensor)
    if fake_device(tensor).type == "cuda" and not name.startswith("torch.cuda."):
        name = name.replace("torch.", "torch.cuda.", 1)
    return name
_BASE_GRAD = torch._C.TensorBase.grad


def _set_grad(tensor: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``tensor.grad = grad`` with torch's check of the devices (C++, which sees two host tensors here)."""
    if grad is not None and fake_device(grad) != fake_device(tensor):
        raise RuntimeError(f"attempting to assign a gradient located on device {fake_device(grad)} to a tensor on "
                           f"{fake_device(tensor)}; please ensure that the gradient and the tensor are on the same "
                           f"device (fake CUDA)")
    _BASE_GRAD.__set__(tensor, grad)


def _fake_torch_cuda(rank: "FakeGpuRank") -> Dict[str, Any]:
    """``torch.cuda``'s functions and classes over ``rank``'s fake devices, by name: availability, devices, streams,
    events, the random generators and what DeepSpeed and Megatron ask of the hardware."""
    return {
        "is_available": lambda: True, "device_count": lambda: rank.device_count,
        "current_device": lambda: rank.current, "set_device": rank.set_device,
        "_lazy_init": lambda: None, "is_initialized": lambda: True, "init": lambda: None,
        "Stream": FakeStream, "Event": FakeEvent, "stream": _StreamContext, "device": _DeviceContext,
        "current_stream": rank.current_stream, "default_stream": rank.default_stream,
        "set_stream": rank.set_stream, "synchronize": rank._synchronize,
        "is_bf16_supported": lambda *a, **k: True, "cudart": lambda: rank.cudart,
        "get_device_capability": lambda device=None: (9, 0), "get_device_name": lambda device=None: "fake GPU",
        "get_rng_state": lambda device="cuda": rank.generator(device).get_state(),
        "set_rng_state": lambda state, device="cuda": rank.generator(device).set_state(state),
        "manual_seed": lambda seed: rank.generator().manual_seed(seed),
        "manual_seed_all": lambda seed: [rank.generator(i).manual_seed(seed) for i in range(rank.device_count)],
        "seed": lambda: rank.generator().seed(), "initial_seed": lambda: rank.generator().initial_seed(),
        "default_generators": rank.generators,
    }


def _fake_to(rank: "FakeGpuRank"):
    """``Tensor.to`` moving a tensor between ``rank``'s fake devices: a copy on the CPU that the dispatch mode tags
    with the target device; to the device it is on already, torch's own ``to``."""
    def to(tensor, *args, copy=False, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        options = dict(dtype=dtype, non_blocking=non_blocking, copy=copy)
        if memory_format is not None:
            options["memory_format"] = memory_format
        if device is None or rank.resolve(device) == fake_device(tensor):
            return _ORIGINAL_TO(tensor, **options)
        # a copy on the CPU (C++ sees two host tensors), which the mode tags with the target device
        return _ORIGINAL_TO(tensor, rank.resolve(device), **dict(options, copy=True))
    return to


def _from_data(make, rank: "FakeGpuRank"):
    """``torch.tensor``/``torch.as_tensor`` (``make``), which allocate out of the dispatcher's sight: made on the
    host, then moved to ``device`` on ``rank``'s fake devices."""
    def made(data, *args, device=None, **kwargs):
        out = make(data, *args, **kwargs)
        return out if device is None else out.to(rank.resolve(device))
    return made


def _patch_tensor_devices(rank: "FakeGpuRank") -> None:
    """Tensors made on, moved to and asked about ``rank``'s fake devices: ``torch.tensor``, ``to``/``cpu``/``cuda``,
    ``device``/``is_cuda``/``get_device``/``type``, ``record_stream``, a storage's ``resize_`` and ``.grad``'s
    device check."""
    rank._patch(torch, "tensor", _from_data(torch.tensor, rank))
    rank._patch(torch, "as_tensor", _from_data(torch.as_tensor, rank))
    rank._patch(torch.Tensor, "to", _fake_to(rank))
    rank._patch(torch.Tensor, "cpu", lambda t, *a, **k: t.to(CPU))
    rank._patch(torch.Tensor, "cuda", lambda t, device=None, non_blocking=False, **k:
                t.to(rank.resolve(device), non_blocking=non_blocking))
    rank._patch(torch.Tensor, "device", property(fake_device))
    rank._patch(torch.Tensor, "is_cuda", property(lambda t: fake_device(t).type == "cuda"))
    rank._patch(torch.Tensor, "get_device", lambda t: fake_device(t).index if fake_device(t).type == "cuda"
                else -1)
    rank._patch(torch.Tensor, "type", _fake_type)
    rank._patch(torch.Tensor, "record_stream", lambda t, stream: rank._record_stream(t, stream))
    rank._patch(torch.UntypedStorage, "resize_", lambda storage, nbytes: rank._resize_storage(storage, nbytes))
    rank._patch(torch.Tensor, "grad", property(_BASE_GRAD.__get__, _set_grad))


# c10d's process-group state (torch 2.13): the world object, the maps its properties read, the group counter (kept
# counting while the fake group lives, so that no group name is taken twice)
_C10D_STATE = ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag",
               "_group_count")


def _set_aside_deepspeed_groups() -> Dict[str, Any]:
    """DeepSpeed's module-level group caches (0.19.8 ``deepspeed.utils.groups``: the world clone its data parallelism
    uses, expert and model-parallel groups, the mpu), emptied for the fake world and returned to be put back: a
    group cached in another test's world would stand for this one (one rank of gloo: DeepSpeed then skips its
    collectives)."""
    try:
        from deepspeed.utils import groups
    except ImportError:
        return {}
    saved = {}
    for name, value in vars(groups).items():
        if name in ("mpu", "mesh_device") or (name.startswith("_") and name.isupper() and not isinstance(value, str)):
            saved[name] = value
            setattr(groups, name, {} if isinstance(value, dict) else None)
    return saved


def _restore_deepspeed_groups(saved: Dict[str, Any]) -> None:
    if saved:
        from deepspeed.utils import groups

        for name, value in saved.items():
            setattr(groups, name, value)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROJECT = tuple(os.path.join(_REPO, folder) + os.sep for folder in ("ds_pseudo_real", "megatron_patches", "launch",
                                                                      "benchmarks"))


def _project_call_site() -> Optional[tuple]:
    """(path in the repository, line) of the innermost frame of the project's own code on the stack: where the
    project issued the collective being checked (directly, or through DeepSpeed's or Megatron's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PROJECT):
            return os.path.relpath(frame.f_code.co_filename, _REPO), frame.f_lineno
        frame = frame.f_back
    return None


class FakeNccl:
    """Collectives as NCCL takes them, for the :class:`FakeGpuRank` ``rank`` (see the module's docstring).
    ``calls`` lists ``(op, devices of its tensors)`` of every collective that passed; :attr:`sites` (this process's,
    across instances) the project's lines that issued one, ``(path, line)``."""

    sites: set = set()

    def __init__(self, rank: FakeGpuRank, group_rank: int = 3, world_size: int = 8):
        self.rank = rank
        self.group_rank, self.world_size = group_rank, world_size
        self.calls: List[tuple] = []
        self.gloo_calls: List[str] = []  # collectives on the gloo groups a job made beside NCCL's (host tensors)
        self._gloo_groups: List[Any] = []
        self._undo: List[tuple] = []

    def _is_gloo(self, group) -> bool:
        return any(group is g for g in self._gloo_groups)

    def check(self, op: str, tensors: List[torch.Tensor], group=None) -> None:
        if group is not None and self._is_gloo(group):
            self.gloo_calls.append(op)
            return
        site = _project_call_site()
        if site is not None:
            FakeNccl.sites.add(site)
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
        self._saved_deepspeed_groups = _set_aside_deepspeed_groups()
        new_group = c10d.new_group

        def new_gloo_or_nccl_group(*args, backend=None, **kwargs):
            # a gloo group beside NCCL's (Megatron's for its distributed optimizer's checkpoints) takes host
            # tensors: made of the fake backend, its collectives are listed apart and not checked as NCCL's
            group = new_group(*args, **kwargs)
            if backend is not None and "gloo" in str(backend).lower():
                self._gloo_groups.append(group)
            return group

        def backend_of(group=None):
            return "gloo" if group is not None and self._is_gloo(group) else "nccl"

        for owner, name, value in ((dist, "get_backend", backend_of), (c10d, "get_backend", backend_of),
                                   (dist, "new_group", new_gloo_or_nccl_group),
                                   (c10d, "new_group", new_gloo_or_nccl_group),
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
        _restore_deepspeed_groups(self._saved_deepspeed_groups)
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
