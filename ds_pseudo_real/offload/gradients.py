"""Gradients of granular offload's own groups (host_params layers kept outside DeepSpeed's optimizer): averaged
over the data-parallel ranks and copied to host buffers a layer at a time, accumulated there over micro-batches.

Owns: the ready sets, the reductions and the device-to-host copies of those gradients, and what the host buffers
hold this step. Must not step or plan. DeepSpeed's rule is followed (0.19.8 ZeRO ``average_tensor``): gradients are
reduced in the engine's communication dtype, summed over the ranks holding the same parameters (for experts their
expert-data-parallel group) and divided by the data-parallel size.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from ds_pseudo_real.offload.host_adam import HOST, HostAdam
from ds_pseudo_real.offload.params import EndOfBackward


EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # gradient dtypes the fp32 host buffers hold exactly


class _Flush:
    """One group's gradients on their way to the host: the copies, their event and the staged micro-batch
    gradients to add to the buffers once the copies are done."""

    def __init__(self, params: List[torch.Tensor], event, staged: Dict[torch.Tensor, torch.Tensor]):
        self.params, self.event, self.staged = params, event, staged


class OwnGradients:
    """The gradients of ``groups`` (own groups: lists of params with ``moe``/``name`` keys for experts).

    With ``stream`` (ZeRO 1/2) a post-accumulate-grad hook on each param marks it ready; once every param of a
    group is ready the group is flushed: one reduction of its gradients flattened together, one batch of copies to
    the host on a side stream with one event, and the device gradients freed. What is not flushed by then (params
    that got no gradient, a group split over graph tasks) is flushed at the end of the backward. Without ``stream``
    (ZeRO 0, whose engine reduces every gradient itself) :meth:`collect` flushes every group at the step. The first
    flush of a param in an optimizer step copies into its host buffer; later ones (gradient accumulation, a shared
    layer set run in several graph tasks) are staged and added when waited for.
    """

    def __init__(self, groups: Sequence[Dict[str, Any]], host: HostAdam, stream: bool):
        self.groups = list(groups)
        self.host = host
        self._group_of = {p: g for g in self.groups for p in g["params"]}
        self.reduce_group = None  # DeepSpeed's data-parallel group (``attach_to_engine``); None: the world
        self.communication_dtype: Optional[torch.dtype] = None  # the engine's, set by ``attach_to_engine``
        # DeepSpeed's model-parallel group (the norm is summed over it; None: no model parallelism) and this rank's
        # tensor-parallel rank, set by ``attach_to_engine``
        self.model_parallel_group = None
        self.tensor_parallel_rank = 0
        self.received: Set[torch.Tensor] = set()  # params whose host buffer holds a gradient this step
        # param -> its gradient's squared L2 norm (a 0-dim fp32 tensor where the gradient was), taken from what its
        # one flush of this step copied, before the copy: the host never reads the gradients for the norm. Dropped
        # when a second flush adds to the buffer (gradient accumulation), whose norm is then read on the host
        self._squares: Dict[torch.Tensor, torch.Tensor] = {}
        self.peak_device_bytes = 0  # the most gradient bytes one flush held on the device
        # group index -> params ready, not flushed (a dict as an ordered set: a param whose gradient is accumulated
        # again before its group is flushed, through a second accumulator, is flushed once with both)
        self._ready: Dict[int, Dict[torch.Tensor, None]] = {}
        self._index = {id(g): i for i, g in enumerate(self.groups)}
        self._in_flight: List[_Flush] = []
        self._end_of_backward = EndOfBackward(self._flush_what_is_left)
        self.moved: Callable[[Dict[str, Any], int], None] = lambda group, size: None
        # the host step during the backward (``ahead.HostStepAhead``), which may take a flush instead of the step
        self.ahead = None
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_accumulated) for p in self._group_of]
                       if stream else [])

    @property
    def params(self):
        return self._group_of.keys()

    # ----- streaming -----------------------------------------------------------------------------------------
    def _on_accumulated(self, p: torch.Tensor) -> None:
        group = self._group_of[p]
        ready = self._ready.setdefault(self._index[id(group)], {})
        ready[p] = None
        self._end_of_backward.arm()
        if len(ready) == len(group["params"]):
            self._flush(group, list(self._ready.pop(self._index[id(group)])), streamed=True)

    def _flush_what_is_left(self) -> None:
        for index in sorted(self._ready):
            self._flush(self.groups[index], list(self._ready.pop(index)), streamed=True)

    def collect(self) -> None:
        """Without streaming: flush the gradients the engine left on the own params (already reduced)."""
        if self._hooks:
            return
        for group in self.groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._flush(group, params, streamed=False)

    @torch.no_grad()
    def _flush(self, group: Dict[str, Any], params: List[torch.Tensor], streamed: bool) -> None:
        """Copy ``params``' gradients to the host; ``streamed``: taken from autograd as it finished them, so
        reduced here first (else the engine reduced them: ZeRO 0)."""
        grads = [p.grad for p in params]
        if streamed:
            self.peak_device_bytes = max(self.peak_device_bytes, sum(g.numel() * g.element_size() for g in grads))
            if dist.is_initialized() and dist.get_world_size(self.reduce_group) > 1:
                grads = self._reduced(group, grads)
        self._wait(params)  # a copy still writing these params' buffers or staging
        for p, grad in zip(params, grads):  # on the stream that made them, as the fp32 the host buffer will hold
            if p not in self.received and grad.dtype in EXACT_IN_FP32:
                self._squares[p] = torch.linalg.vector_norm(grad, dtype=torch.float32).pow(2)
        cuda = grads[0].is_cuda
        stream = self.host.to_host_stream
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(grads[0].device))
        staged = {}
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for p, grad in zip(params, grads):
                if p in self.received:
                    target = staged[p] = self.host.buffer(p, "staging")
                    self._squares.pop(p, None)
                else:
                    target = self.host.grad_buffer(p)
                    self.received.add(p)
                target.copy_(grad, non_blocking=cuda)
                if cuda:
                    grad.record_stream(stream)  # freed below, still read by the copy
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(stream)
        flush = _Flush(params, event, staged)
        if not (streamed and self.ahead is not None and self.ahead.take(group, flush)):
            self._in_flight.append(flush)
        self.moved(group, sum(p.numel() * 4 for p in params))
        for p in params:
            p.grad = None

    def _reduced(self, group: Dict[str, Any], grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The group's gradients summed over its sum group and divided by the data-parallel size, in the
        communication dtype (DeepSpeed's rounding: bf16 runs reduce in bf16), in one flat all-reduce."""
        dtype = self.communication_dtype or grads[0].dtype
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        sum_group = self.sum_group(group)
        if dist.get_world_size(sum_group) > 1:
            dist.all_reduce(flat, group=sum_group)
        flat.div_(dist.get_world_size(self.reduce_group))
        return [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)]

    def sum_group(self, group: Dict[str, Any]):
        """The ranks a group's gradients are summed over: its expert-data-parallel group for MoE experts."""
        if group.get("moe"):
            from ds_pseudo_real.ds_state import expert_data_parallel_group

            return expert_data_parallel_group(group["name"])
        return self.reduce_group

    def _wait(self, params: Optional[List[torch.Tensor]] = None) -> None:
        """Wait for the copies in flight (those touching ``params``, or all) and add their staged gradients."""
        wanted = None if params is None else set(params)
        keep = []
        for flush in self._in_flight:
            if wanted is not None and wanted.isdisjoint(flush.params):
                keep.append(flush)
                continue
            if flush.event is not None:
                flush.event.synchronize()
            for p, staged in flush.staged.items():
                self.host.grad_buffers[p].add_(staged)
        self._in_flight = keep

    # ----- at the step ---------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Everything of this step on the host: gradients not flushed yet (without streaming) flushed, all copies
        waited for, params that got no gradient given a zero one (DeepSpeed steps those with zeros too)."""
        if self.ahead is not None:
            self.ahead.wait()  # it adds the gradients of the flushes it took
        self.collect()
        self._wait()
        for p in self._group_of:
            if p not in self.received:
                self.host.grad_buffer(p).zero_()

    def norm(self, sum_model_parallel: bool = True) -> torch.Tensor:
        """L2 norm of this step's gradients (averaged over the ranks), fp32 on the host.

        Experts count as DeepSpeed counts its expert groups: the squares of every rank's experts summed over the
        data-parallel ranks (each expert once: divided by its expert-data-parallel replicas). Under model
        parallelism, as DeepSpeed counts its own: a tensor-parallel slice on every rank, a parameter replicated
        over the tensor-parallel ranks on the first only, and (``sum_model_parallel``) the squares summed over the
        model-parallel group (every stage's and slice's). A collective when there are expert groups or a
        model-parallel group: call it on every rank, own groups or none."""
        from ds_pseudo_real.ds_state import splits_over_tensor_parallel

        self.settle()
        squares = {False: torch.zeros((), dtype=torch.float32), True: torch.zeros((), dtype=torch.float32)}
        counted = [p for p in self._group_of if p in self.received  # in model order: the sum is reproducible
                   and (self.tensor_parallel_rank == 0 or splits_over_tensor_parallel(p))]  # else on the first
        taken = dict(self.ahead.squares) if self.ahead is not None else {}  # by the worker, during the backward
        flushed = [p for p in counted if p in self._squares]
        if flushed:  # taken before their copies, where the gradients were: to the host at once
            taken.update(zip(flushed, torch.stack([self._squares[p] for p in flushed]).to(HOST).unbind()))
        for p in counted:
            group = self._group_of[p]
            square = taken.get(p)
            if square is None:
                square = torch.linalg.vector_norm(self.host.grad_buffers[p]).pow(2)
            if group.get("moe") and dist.is_initialized():
                square = square / dist.get_world_size(self.sum_group(group))
            squares[bool(group.get("moe"))] += square
        if any(g.get("moe") for g in self.groups) and dist.is_initialized():
            experts = squares[True].to(self.host.device)
            dist.all_reduce(experts, group=self.reduce_group)
            squares[True] = experts.to(HOST)
        total = squares[False] + squares[True]
        if (sum_model_parallel and self.model_parallel_group is not None
                and dist.get_world_size(self.model_parallel_group) > 1):
            total = total.to(self.host.device)
            dist.all_reduce(total, group=self.model_parallel_group)
            total = total.to(HOST)
        return total.sqrt()

    def drop(self) -> None:
        """Forget this step's gradients, on the device and in the host buffers (after a step, or a skipped one)."""
        for p in self._group_of:
            p.grad = None
        self._ready.clear()
        if self.ahead is not None:
            self.ahead.wait()
        self._wait()  # a copy still in flight would write a buffer after this
        self.received.clear()
        self._squares.clear()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.ahead is not None:
            self.ahead.shutdown()
