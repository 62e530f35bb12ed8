"""Host-resident working parameters for the ``host_params`` level: each layer using them has an explicit
:class:`Residency` (on host, fetching, on device, released), changed only by :meth:`HostParamStore._transition`,
driven by the layer's pre/post forward and backward hooks, an end-of-backward callback and the optimizer step.

Owns: the host copy of each such parameter (in fp32 also the optimizer's master) and the device buffers.
Must not step or plan. Written against torch 2.x module hooks and DeepSpeed 0.19.8, which leaves the Parameters it
does not optimize as they are: under ZeRO 1/2 and the bf16 optimizer these layers' parameters are kept out of
DeepSpeed's optimizer (``GranularOffloadOptimizer`` own groups); fp32 ZeRO 0 never flattens them.

Outside the model's forward and ``ON_DEVICE`` a layer's ``p.data`` is the host tensor, so ``state_dict``,
``load_state_dict`` and DeepSpeed's initial broadcast read and write the host copy. At most two layers are fetched
at any time: the one in use and the next one (prefetched).

Each layer's device copies are the same tensors at every fetch; a release frees their storage in place and a fetch
refills it (FSDP's way). Autograd saves views of them for the backward (``F.linear`` saves ``weight.t()``), which
a release therefore really frees, and which read the refetched values in the backward; it saves a leaf Parameter
itself, which reads whatever ``p.data`` is then, the refetched copy too.

While the model's forward records a graph, a released parameter keeps pointing at its freed device copy until the
forward ends (never read: the next layer using it fetches first). Pointing it back at the host tensor between
two layers sharing it would change its type on CUDA (host -> device), and torch gives a parameter whose ``.data``
changed type a new gradient accumulator at its next use: one gradient, post-accumulate hook, all-reduce and copy
to the host per layer instead of one per backward.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from ds_pseudo_real.device import rank_device
from ds_pseudo_real.offload.layers import rank_layers
from ds_pseudo_real.pinned import host_empty


class Residency(str, enum.Enum):
    """Where a layer's host parameters are, as the forward and backward see them."""

    ON_HOST = "on host"  # not fetched since the last optimizer step: p.data is the host tensor
    FETCHING = "fetching"  # a device copy is issued (prefetched); p.data is still the host tensor
    ON_DEVICE = "on device"  # p.data is the device copy; the layer's forward, recompute or backward runs
    # fetched and dropped since the last step, the device copy freed: p.data is the host tensor again (during the
    # model's forward, once it ends)
    RELEASED = "released"


FETCHED = (Residency.FETCHING, Residency.ON_DEVICE)
# The transitions the hooks may take; anything else is a bug in the hooks and raises.
_ALLOWED = {
    Residency.ON_HOST: {Residency.FETCHING},
    Residency.RELEASED: {Residency.FETCHING, Residency.ON_HOST},
    Residency.FETCHING: {Residency.ON_DEVICE, Residency.RELEASED},
    Residency.ON_DEVICE: {Residency.RELEASED},
}


# torch internals the hooks rely on (torch 2.x): which backward runs, and a callback at its end
TORCH_INTERNALS = (("torch._C", torch._C, "_current_graph_task_id"),
                   ("torch.autograd.Variable._execution_engine", torch.autograd.Variable._execution_engine,
                    "queue_callback"))


def check_torch_internals() -> None:
    """Refuse to place layers at host_params on a torch without the internals the hooks use, naming the missing
    one: without them a recompute inside the backward would read weights from before the step."""
    for owner, target, name in TORCH_INTERNALS:
        if not hasattr(target, name):
            raise RuntimeError(f"granular_offload host_params needs {owner}.{name}, which torch {torch.__version__} "
                               f"does not have; install a torch within ds_state.SUPPORTED_VERSIONS")


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (torch 2.x)."""
    return torch._C._current_graph_task_id() != -1


class EndOfBackward:
    """Calls ``callback`` once at the end of every backward graph task in which :meth:`arm` was called (torch 2.x
    autograd ``queue_callback``). Reentrant activation checkpointing runs nested graph tasks: each ends on its own."""

    def __init__(self, callback):
        self._callback = callback
        self._armed_for: Optional[int] = None

    def arm(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._armed_for != task:
            self._armed_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self._armed_for = None
        self._callback()


def in_one_allocation(params: Sequence[nn.Parameter], pinned: bool) -> bool:
    """Whether ``params`` are consecutive views, in order, filling one host allocation (pinned as asked): the
    layout :class:`HostParamStore` packs a layer's host params into."""
    first = params[0].data
    storage = first.untyped_storage()
    offset = 0
    for p in params:
        t = p.data
        if (t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() != offset):
            return False
        offset += t.numel()
    return first.is_pinned() == pinned and offset * first.element_size() == storage.nbytes()


def one_allocation(params: Sequence[nn.Parameter], dtype: torch.dtype, pin_memory: bool) -> List[torch.Tensor]:
    """One host allocation (pinned when ``pin_memory``, at its exact size) of ``dtype`` holding ``params`` one after
    the other: a view shaped like each param, in order (the layout :func:`in_one_allocation` recognises)."""
    flat = host_empty(sum(p.numel() for p in params), dtype, pin_memory)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def host_param_views(layers: Sequence[nn.Module], host_ids: Set[int], dtype_of: Callable[[nn.Parameter], torch.dtype],
                     pin_memory: bool) -> Dict[int, torch.Tensor]:
    """Storage for the host params of a model about to be built: per layer and dtype one host allocation (pinned
    when ``pin_memory``), each param (``id`` in ``host_ids``, in dtype ``dtype_of(param)``) a view of it in the
    order :class:`HostParamStore` packs them, so that the store takes them as they are instead of copying them into
    its own allocation. Returns {id of the (meta) param: its view}; a param shared by several layers gets its
    storage with the first."""
    views: Dict[int, torch.Tensor] = {}
    for layer in layers:
        params = [p for p in layer.parameters() if id(p) in host_ids and id(p) not in views]
        for dtype in dict.fromkeys(dtype_of(p) for p in params):
            todo = [p for p in params if dtype_of(p) == dtype]
            views.update(zip(map(id, todo), one_allocation(todo, dtype, pin_memory)))
    return views


class HostParamStore:
    """Keeps the parameters in ``host_param_lists`` on the host and serves them to the layers that use them.

    ``device``: where the layers run (default: :func:`ds_pseudo_real.device.rank_device`). ``trace=True`` records
    every transition as ``(layer, old state, new state)`` in :attr:`transitions`.
    """

    def __init__(self, model: nn.Module, layer_path: str, host_param_lists: Sequence[Sequence[nn.Parameter]],
                 prefetch: bool = True, pin_memory: bool = True, device: Optional[torch.device] = None,
                 trace: bool = False):
        check_torch_internals()
        wanted = {id(p) for params in host_param_lists for p in params}
        self.device = device or rank_device()
        self.prefetch = prefetch
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        # one entry per layer module using host params, in layer order (a pseudo model's shared set: every member)
        self._entries: List[List[nn.Parameter]] = []
        modules = []
        # each module once: a PipelineModule's tied module is the layer at several positions, its hooks fire per call
        for layer in dict.fromkeys(layer for _, layer in rank_layers(model, layer_path)[0]):
            params = [p for p in layer.parameters() if id(p) in wanted]
            if params:
                self._entries.append(params)
                modules.append(layer)
        self._pin = pin_memory and self._cuda
        self._host: Dict[nn.Parameter, torch.Tensor] = {}
        self._packed = set()  # params whose host copy is a view of their layer's allocation
        self.repacked_bytes = 0  # copied into new host allocations by _pack (0: the layers were built in place)
        for params in self._entries:
            self._pack(params)
        self.state: List[Residency] = [Residency.ON_HOST] * len(self._entries)
        self._copies: Dict[int, List[torch.Tensor]] = {}  # layer -> its device copies (storage freed when released)
        self._buffers: Dict[int, tuple] = {}  # layer -> (device tensors, copy-done event or None); only when FETCHED
        self._unbound: Set[int] = set()  # released layers whose params still point at their freed copies
        self._forward = False  # the model's forward runs (outside a backward)
        self.transitions: Optional[List[tuple]] = [] if trace else None
        # called before anything reads or writes the host params (a fetch, a module's state_dict or
        # load_state_dict, ``host_tensor``): a host step writing them in another thread finishes first
        self.before_access: Optional[Callable[[], None]] = None
        self.fetched_bytes = 0  # since construction
        self.peak_buffered_bytes = 0
        self._handles = [model.register_forward_pre_hook(lambda m, a: self._model_forward(True)),
                         model.register_forward_hook(lambda m, a, o: self._model_forward(False), always_call=True)]
        self._converting = list(dict.fromkeys(modules))
        for module in self._converting:
            self._convert_on_host(module)
        self._end_of_backward = EndOfBackward(self._released_at_end_of_backward)
        for k, module in enumerate(modules):
            self._handles += [
                module.register_forward_pre_hook(lambda m, a, k=k: self._before_forward(k)),
                module.register_forward_hook(lambda m, a, o, k=k: self._after_forward(k)),
                module.register_full_backward_pre_hook(lambda m, g, k=k: self._before_backward(k)),
                module.register_full_backward_hook(lambda m, gi, go, k=k: self._after_backward(k, gi)),
                module.register_state_dict_pre_hook(lambda *_: self._access()),
                module.register_load_state_dict_pre_hook(lambda *_: self._access()),
            ]

    def _access(self) -> None:
        if self.before_access is not None:
            self.before_access()

    # ----- the one place residency changes -------------------------------------------------------------------
    def _transition(self, k: int, new: Residency) -> None:
        old = self.state[k]
        if new not in _ALLOWED[old]:
            raise RuntimeError(f"host_params layer {k}: {old.value} -> {new.value} is not a residency transition")
        params = self._entries[k]
        if new is Residency.FETCHING:
            self._buffers[k] = self._copy_to_device(k)
        elif new is Residency.ON_DEVICE:
            tensors, event = self._buffers[k]
            if event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(event)
                for t in tensors:
                    t.record_stream(compute)  # allocated on the copy stream, used on this one
            for p, t in zip(params, tensors):
                p.data = t
        elif new is Residency.RELEASED:
            tensors, _ = self._buffers.pop(k)
            for t in tensors:
                t.untyped_storage().resize_(0)  # with the views autograd saved of it
            if self._forward and torch.is_grad_enabled() and not _in_backward():
                self._unbound.add(k)  # pointed back at the host when the forward ends
            else:
                self._point_at_host([k])
        self.state[k] = new
        if self.transitions is not None:
            self.transitions.append((k, old, new))

    def _copy_to_device(self, k: int) -> tuple:
        """Issue the copy of layer ``k``'s host params into its device copies, their storage refilled in place (on
        the side stream on CUDA: it overlaps the running layer), after taking back whatever replaced the params
        since the last release."""
        params = self._entries[k]
        self._access()
        self._adopt(params)
        hosts = [self._host[p] for p in params]
        event = None
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():  # allocated there too
            copies = self._copies.get(k)
            if copies is None or [(c.dtype, c.shape) for c in copies] != [(h.dtype, h.shape) for h in hosts]:
                copies = self._copies[k] = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]
            for copy, host in zip(copies, hosts):
                copy.untyped_storage().resize_(copy.numel() * copy.element_size())
                copy.copy_(host, non_blocking=self._cuda)
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
        self.fetched_bytes += sum(c.numel() * c.element_size() for c in copies)
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
        return copies, event

    @property
    def buffered_bytes(self) -> int:
        """Device bytes the layers' copies hold now: their live storages (a released copy's is freed)."""
        storages = {id(s): s for s in (t.untyped_storage() for t in self._device_tensors())}
        return sum(s.nbytes() for s in storages.values())

    def _device_tensors(self) -> List[torch.Tensor]:
        return [t for copies in self._copies.values() for t in copies] + [
            t for fetched, _ in self._buffers.values() for t in fetched]

    def _model_forward(self, begins: bool) -> None:
        """The model's forward begins or ends (outside a backward): at its end, the params released during it point
        back at their host tensors, every use of them in it done."""
        if _in_backward():
            return
        self._forward = begins
        if not begins:
            self._point_released_at_host()

    def _point_released_at_host(self) -> None:
        self._point_at_host(self._unbound)
        self._unbound.clear()

    def _point_at_host(self, layers) -> None:
        """Point the params of ``layers`` (being released, or released) back at their host tensors, or, for those
        another layer on the device uses (a pseudo model's shared set: a layer whose input needs no gradient stays
        on the device until the end of the backward), at that layer's copy."""
        running = {p: t for k, state in enumerate(self.state) if state is Residency.ON_DEVICE and k not in layers
                   for p, t in zip(self._entries[k], self._buffers[k][0])}
        for k in layers:
            for p in self._entries[k]:
                p.data = running.get(p, self._host[p])

    # ----- what the hooks ask for ----------------------------------------------------------------------------
    def _fetch(self, k: int) -> None:
        if 0 <= k < len(self._entries) and self.state[k] not in FETCHED:
            self._transition(k, Residency.FETCHING)

    def _use(self, k: int, then: int) -> None:
        self._fetch(k)
        if self.state[k] is Residency.FETCHING:
            self._transition(k, Residency.ON_DEVICE)
        if self.prefetch:
            self._fetch(then)

    def _release(self, k: int) -> None:
        if self.state[k] in FETCHED:
            self._transition(k, Residency.RELEASED)

    def release_all(self) -> None:
        """Drop every device copy and mark every layer ``ON_HOST``: called before the optimizer writes the host
        params, so that no copy fetched before the step (a prefetch the backward never used) reaches the next
        forward with the old values."""
        for k in range(len(self._entries)):
            self._release(k)
            if self.state[k] is Residency.RELEASED:
                self._transition(k, Residency.ON_HOST)
        self._point_released_at_host()

    # The hooks. A forward inside a backward is activation checkpointing's recompute: the layer's backward follows
    # at once (so it stays on the device) and the next layer to need its parameters is the one before it.
    def _before_forward(self, k: int) -> None:
        if _in_backward():
            self._end_of_backward.arm()
            self._use(k, k - 1)
        else:
            self._use(k, k + 1)

    def _after_forward(self, k: int) -> None:
        if not _in_backward():
            self._release(k)

    def _before_backward(self, k: int) -> None:
        self._end_of_backward.arm()
        self._use(k, k - 1)

    def _after_backward(self, k: int, grad_input) -> None:
        # With no input gradient to compute (frozen embeddings before the first layer) torch 2.x fires the full
        # backward hook at once, before the layer's backward has run (grad_input all None): not released here then.
        if any(g is not None for g in grad_input):
            self._release(k)

    def _released_at_end_of_backward(self) -> None:
        """End of a backward's graph task: release the layers a recompute or a frozen-input layer left on the
        device. A layer prefetched for a backward still to come stays ``FETCHING``: reentrant checkpointing runs
        each layer's recompute and backward as a graph task of its own, nested in the whole backward, whose next
        task uses the prefetched layer; :meth:`release_all` at the step drops one the backward never used."""
        for k, state in enumerate(self.state):
            if state is Residency.ON_DEVICE:
                self._release(k)

    # ----- host copies ---------------------------------------------------------------------------------------
    def _convert_on_host(self, module: nn.Module) -> None:
        """Conversions of the model (``Module._apply``: the engine's ``.to(device)``, a dtype cast) reach this
        layer's host params one at a time and leave them on the host, converted: the device never holds the
        layers while the engine is built. Per instance, undone by :meth:`remove` (torch 2.x ``Module._apply``)."""
        original = module._apply

        def _apply(fn, *args, **kwargs):
            return original(lambda t: self._converted(t, fn), *args, **kwargs)

        module._apply = _apply

    def _converted(self, t: torch.Tensor, fn) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) or t not in self._host:
            return fn(t)
        probe = fn(torch.empty(0, dtype=t.dtype))  # where and in what dtype the conversion puts a tensor
        out = fn(t) if probe.device.type == "cpu" else t.detach().to(dtype=probe.dtype)  # never via the device
        if out is t:
            return out
        pin = self._host[t].is_pinned()
        if out.device.type != "cpu" or out.is_pinned() != pin:
            host = host_empty(out.shape, out.dtype, pin)
            host.copy_(out)
            out = host
        self._host[t] = out
        self._packed.discard(t)
        return out

    def _pack(self, params: List[nn.Parameter]) -> None:
        """Give a layer's host params one host allocation per dtype, each param a view of it, holding the param's
        current value: the allocations the planner counts, not one per parameter. Params already packed with another
        layer (a pseudo model's shared set) are left as they are."""
        for dtype in dict.fromkeys(p.dtype for p in params):
            todo = [p for p in params if p.dtype == dtype and p not in self._packed]
            if not todo:
                continue
            if in_one_allocation(todo, self._pin):  # built in place (``host_param_views``): nothing to copy
                for p in todo:
                    self._host[p] = p.data
                    self._packed.add(p)
                continue
            self.repacked_bytes += sum(p.numel() for p in todo) * todo[0].element_size()
            for p, host in zip(todo, one_allocation(todo, dtype, self._pin)):
                host.copy_(p.detach())
                self._host[p] = host
                self._packed.add(p)
                p.data = host

    @torch.no_grad()
    def give_missing_gradients(self) -> None:
        """A zero gradient on the device for every host param that got none (a layer the step did not run), where
        the fetched layers' gradients are: fp32 ZeRO 0 all-reduces every parameter's gradient itself and makes a
        missing one on ``param.device``, the host here, which NCCL refuses."""
        for p in dict.fromkeys(p for params in self._entries for p in params):
            if p.requires_grad and p.grad is None:
                zeros = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                host, p.data = p.data, zeros  # torch assigns a gradient on its tensor's device only
                p.grad = zeros
                p.data = host

    def host_tensor(self, p: nn.Parameter, access: bool = True) -> torch.Tensor:
        """The host copy of ``p``: its working value between uses and the optimizer's fp32 master (``access``
        False: without waiting for a host step writing it, for that step itself)."""
        if access:
            self._access()
        return self._host[p]

    def _adopt(self, params: List[nn.Parameter]) -> None:
        """Something replaced ``p.data`` since the last release (the engine moving the model to the device, or
        casting it to bf16): take its value, in its dtype, as the host copy and point ``p`` back at the host."""
        ours = {id(t.untyped_storage()) for t in self._device_tensors()}  # a released copy's storage too
        for p in params:
            host = self._host[p]
            if p.data.data_ptr() != host.data_ptr() and id(p.data.untyped_storage()) not in ours:
                if host.dtype != p.dtype:
                    host = self._host[p] = host_empty(p.shape, p.dtype, host.is_pinned())
                    self._packed.discard(p)
                host.copy_(p.detach())
                p.data = host

    def adopt_all(self) -> None:
        """Take back every parameter replaced outside ``Module._apply`` while the engine was built (DeepSpeed
        0.19.8 casts to bf16 by setting ``p.data``), so that the host copies hold the values training starts from."""
        self._access()
        for params in self._entries:
            self._adopt(params)
            self._pack(params)  # the cast gave each param an allocation of its own

    def remove(self) -> None:
        """Take the hooks off; the parameters stay on the host."""
        self.release_all()
        self._copies.clear()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._converting:
            module.__dict__.pop("_apply", None)
        self._converting = []
