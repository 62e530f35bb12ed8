"""Host-resident working parameters for the ``host_params`` level: module hooks that fetch a layer's parameters
to the device just before its forward and its backward (prefetching the next layer) and release them after.

Owns: the host copy of each such parameter (in fp32 also the optimizer's master) and the device buffers.
Must not step or plan. Written against torch 2.x module hooks and DeepSpeed 0.19.8, which leaves the Parameters it
does not optimize as they are: under ZeRO 1/2 and the bf16 optimizer these layers' parameters are kept out of
DeepSpeed's optimizer (``GranularOffloadOptimizer`` own groups); fp32 ZeRO 0 never flattens them.

Between uses ``p.data`` is the host tensor, so ``state_dict``, ``load_state_dict`` and DeepSpeed's initial
broadcast read and write the host copy. Autograd saves a leaf Parameter itself, not its storage, so re-fetching
before the backward gives the layer's backward the same values it ran forward with. Activation checkpointing
(reentrant or not) recomputes a layer's forward inside the backward: see the hooks below. At most two layers are
fetched at any time: the one in use and the next one (prefetched).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ds_pseudo_real.sharing import get_layer_list


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (torch 2.x)."""
    return torch._C._current_graph_task_id() != -1


class HostParamStore:
    """Keeps the parameters in ``host_param_lists`` on the host and serves them to the layers that use them."""

    def __init__(self, model: nn.Module, layer_path: str, host_param_lists: Sequence[Sequence[nn.Parameter]],
                 prefetch: bool = True, pin_memory: bool = True, device: Optional[torch.device] = None):
        wanted = {id(p) for params in host_param_lists for p in params}
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.prefetch = prefetch
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream() if self._cuda else None
        # one entry per layer module using host params, in layer order (a pseudo model's shared set: every member)
        self._entries: List[List[nn.Parameter]] = []
        modules = []
        for layer in get_layer_list(model, layer_path):
            params = [p for p in layer.parameters() if id(p) in wanted]
            if params:
                self._entries.append(params)
                modules.append(layer)
        self._host: Dict[nn.Parameter, torch.Tensor] = {}
        for params in self._entries:
            for p in params:
                if p not in self._host:
                    host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin_memory and self._cuda)
                    host.copy_(p.detach())
                    self._host[p] = host
                    p.data = host
        self._buffers: Dict[int, tuple] = {}  # entry -> (device tensors, ready event or None)
        self.fetched_bytes = 0  # since construction
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        self._handles = []
        self._converting = list(dict.fromkeys(modules))
        for module in self._converting:
            self._convert_on_host(module)
        self._end_of_backward_queued_for: Optional[int] = None
        for k, module in enumerate(modules):
            self._handles += [
                module.register_forward_pre_hook(lambda m, a, k=k: self._before_forward(k)),
                module.register_forward_hook(lambda m, a, o, k=k: self._after_forward(k)),
                module.register_full_backward_pre_hook(lambda m, g, k=k: self._before_backward(k)),
                module.register_full_backward_hook(lambda m, gi, go, k=k: self._after_backward(k, gi)),
            ]

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
            host = torch.empty(out.shape, dtype=out.dtype, device="cpu", pin_memory=pin)
            host.copy_(out)
            out = host
        self._host[t] = out
        return out

    def host_tensor(self, p: nn.Parameter) -> torch.Tensor:
        """The host copy of ``p``: its working value between uses and the optimizer's fp32 master."""
        return self._host[p]

    def _adopt(self, params: List[nn.Parameter]) -> None:
        """Something replaced ``p.data`` since the last release (the engine moving the model to the device, or
        casting it to bf16): take its value, in its dtype, as the host copy and point ``p`` back at the host."""
        live = {t.data_ptr() for tensors, _ in self._buffers.values() for t in tensors}
        for p in params:
            host = self._host[p]
            if p.data.data_ptr() != host.data_ptr() and p.data.data_ptr() not in live:
                if host.dtype != p.dtype:
                    host = self._host[p] = torch.empty(p.shape, dtype=p.dtype, device="cpu",
                                                       pin_memory=host.is_pinned())
                host.copy_(p.detach())
                p.data = host

    def adopt_all(self) -> None:
        """Take back every parameter replaced outside ``Module._apply`` while the engine was built (DeepSpeed
        0.19.8 casts to bf16 by setting ``p.data``), so that the host copies hold the values training starts from."""
        for params in self._entries:
            self._adopt(params)

    def _fetch(self, k: int) -> None:
        if k in self._buffers or not 0 <= k < len(self._entries):
            return
        params = self._entries[k]
        self._adopt(params)
        event = None
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                tensors = [self._host[p].to(self.device, non_blocking=True) for p in params]
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            tensors = [self._host[p].clone() for p in params]  # the same path with the device being the CPU
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.fetched_bytes += size
        self.buffered_bytes += size
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
        self._buffers[k] = (tensors, event)

    def _use(self, k: int, then: int) -> None:
        self._fetch(k)
        tensors, event = self._buffers[k]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            for t in tensors:
                t.record_stream(torch.cuda.current_stream())  # allocated on the copy stream, used on this one
        for p, t in zip(self._entries[k], tensors):
            p.data = t
        if self.prefetch:
            self._fetch(then)

    # The hooks. A forward that runs inside a backward is activation checkpointing's recompute: the layer's backward
    # follows at once (so it stays fetched), the next layer to need its parameters is the one before it, and the
    # end-of-backward callback releases whatever a recompute or a layer whose input needs no gradient left fetched,
    # so that no buffer outlives the backward and reaches the next forward after the step.
    def _before_forward(self, k: int) -> None:
        if _in_backward():
            self._queue_end_of_backward()
            self._use(k, k - 1)
        else:
            self._use(k, k + 1)

    def _after_forward(self, k: int) -> None:
        if not _in_backward():
            self._release(k)

    def _before_backward(self, k: int) -> None:
        self._queue_end_of_backward()
        self._use(k, k - 1)

    def _after_backward(self, k: int, grad_input) -> None:
        # With no input gradient to compute (frozen embeddings before the first layer) torch 2.x fires the full
        # backward hook at once, before the layer's backward has run (grad_input all None): not released here then.
        if any(g is not None for g in grad_input):
            self._release(k)

    def _queue_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._end_of_backward_queued_for != task:
            self._end_of_backward_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued_for = None
        for k in list(self._buffers):
            self._release(k)

    def _release(self, k: int) -> None:
        tensors, _ = self._buffers.pop(k, ((), None))
        self.buffered_bytes -= sum(t.numel() * t.element_size() for t in tensors)
        for p in self._entries[k]:
            p.data = self._host[p]

    def remove(self) -> None:
        """Take the hooks off; the parameters stay on the host."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._converting:
            module.__dict__.pop("_apply", None)
        self._converting = []
