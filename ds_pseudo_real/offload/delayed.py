"""The host step one optimizer step late (``granular_offload.host_step: "delayed"``, ZeRO-Offload's delayed parameter
update): the own groups' host step of optimizer step t runs in a worker thread during the forward and backward of
step t + 1, and its result reaches the host params (what the layers fetch) after step t + 1's backward. A change of
the math, opt-in: the gradient of step t + 1 is taken at the params before step t's update.

Owns: the worker, its own kernel instance (the training thread steps DeepSpeed's groups at the next step number
meanwhile), the second gradient buffer each own param's delayed step reads while the next backward fills the first,
and publishing a finished step into the host params. Must not reduce or copy gradients (``gradients``), plan, or
touch the engine.

The worker takes its work in order: at step t + 1's optimizer step, the publishing of step t (a copy of the masters
into the host params, queued behind step t itself) and then step t + 1. The training thread goes on at once (to
DeepSpeed's groups, the next forward); the first read of the host params after it (a fetch, a module's state_dict)
waits for the publishing (``HostParamStore.before_access``), as the next backward's writes into the gradient buffer
step t read do, since every own layer is fetched before its backward.

What it keeps exact: the delayed step is the sequential step's kernel calls on step t's gradients, with step t's
gradient factor (loss scale and clipping), learning rate and betas. The fp32 master is a host buffer of its own
(in fp32 too, where the sequential step steps the host params themselves), so the step in flight never writes what
a fetch reads. The first ``from_step`` optimizer steps are sequential (ZeRO-Offload turns the delay on after its first
steps). A step DeepSpeed skips (an inf or NaN gradient) steps nothing; the update in flight is published at the next
step. A checkpoint waits for the step in flight: it holds the host params as published (what the next forward reads)
and the fp32 master with the update applied, so a resumed run publishes it at its first step, as the run it resumes
would have.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ds_pseudo_real import ds_state
from ds_pseudo_real.offload.ahead import step_param
from ds_pseudo_real.offload.host_adam import HOST_PARAMS, HostAdam

SPARE_GRADIENT = "delayed_grad"  # the kind of the second host gradient buffer (``HostAdam.buffer``)


class DelayedHostStep:
    """Steps own groups one optimizer step late, in a worker thread (see the module docstring).

    ``host``: the optimizer's :class:`HostAdam` (its fp32 masters kept apart from the host params); ``host_params``:
    its ``HostParamStore``; ``state_of(p)``: p's optimizer state; ``from_step``: optimizer steps run sequentially
    before the delay starts.
    """

    def __init__(self, host: HostAdam, host_params, state_of: Callable[[torch.Tensor], Dict[str, Any]],
                 from_step: int = 0):
        self.host = host
        self.host_params = host_params
        self.state_of = state_of
        self.from_step = from_step
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="delayed host step")
        self._kernel = host.kernel_instance()
        self._kernel_step = 0  # the last step number the worker's kernel instance saw
        self._queued: List[concurrent.futures.Future] = []  # in the worker's order
        self._publishing: Optional[concurrent.futures.Future] = None
        self._spare: Dict[torch.Tensor, torch.Tensor] = {}  # param -> the gradient buffer not being filled
        self.delayed = 0  # optimizer steps whose own-group step ran late
        self.published = 0  # own-group steps published into the host params
        host_params.before_access = self.published_wait

    def reserve(self, groups: List[Dict[str, Any]]) -> None:
        """Allocate what the delay holds besides the sequential step (the plan counts it): each param's fp32
        master apart from its host params and its second gradient buffer."""
        for group in groups:
            for p in group["params"]:
                self.host.master(p, HOST_PARAMS)
                self._spare_buffer(p)

    def _spare_buffer(self, p: torch.Tensor) -> torch.Tensor:
        spare = self._spare.get(p)
        if spare is None:
            spare = self._spare[p] = self.host.buffer(p, SPARE_GRADIENT)
        return spare

    def delays(self, steps_taken: int) -> bool:
        """Whether the own-group step after ``steps_taken`` optimizer steps is delayed."""
        return steps_taken >= self.from_step

    def submit(self, groups: List[Dict[str, Any]], factor: float) -> None:
        """Queue the step of ``groups`` with this step's gradients, times ``factor``, and this step's
        hyperparameters, behind what the worker has. Their gradient buffers are swapped with the spare ones first,
        so the next backward fills the others."""
        work: List[Tuple[Dict[str, Any], int, Dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group in groups:
            hyper = {k: v for k, v in group.items() if k != "params"}  # as at this step: the schedule moves on
            for p in group["params"]:
                state = self.host.state(p, self.state_of(p))
                master = self.host.master(p, HOST_PARAMS)
                filled = self.host.grad_buffers[p]
                self.host.grad_buffers[p], self._spare[p] = self._spare_buffer(p), filled
                state["step"] += 1
                work.append((hyper, state["step"], state, master, filled))
        self._queue(self._step, work, factor)
        self.delayed += 1

    def _queue(self, fn, *args) -> concurrent.futures.Future:
        future = self._worker.submit(fn, *args)
        self._queued.append(future)
        return future

    @torch.no_grad()
    def _step(self, work, factor: float) -> None:
        if work and work[0][1] != self._kernel_step + 1:  # the first delayed step, or after a resume
            ds_state.replay_kernel_steps(self._kernel, work[0][1] - 1, work[0][0])
        for group, step, state, master, grad in work:
            step_param(self.host, group, state, master, grad, factor, step, self._kernel)
        self._kernel_step = work[-1][1] if work else self._kernel_step

    def wait(self) -> None:
        """Until the worker has done all it was given (raising what it raised)."""
        queued, self._queued = self._queued, []
        self._publishing = None
        for future in queued:
            future.result()

    def published_wait(self) -> None:
        """Until the last publishing queued is done (and what was queued before it): before the host params are
        read or written."""
        if self._publishing is None:
            return
        last = self._queued.index(self._publishing)
        done, self._queued = self._queued[:last + 1], self._queued[last + 1:]
        self._publishing = None
        for future in done:
            future.result()

    def publish(self, groups: List[Dict[str, Any]]) -> None:
        """Queue the writing of the masters into the host params (rounded in 16 bits), behind the step in flight.
        Called at an optimizer step, with every fetched copy released: the next read of the host params waits for
        it (:meth:`published_wait`)."""
        pairs = [(self.host_params.host_tensor(p, access=False), self.host.master(p, HOST_PARAMS))
                 for group in groups for p in group["params"]]
        self._publishing = self._queue(self._copy, pairs)
        self.published += 1

    @staticmethod
    @torch.no_grad()
    def _copy(pairs) -> None:
        for host, master in pairs:
            host.copy_(master)

    def shutdown(self) -> None:
        self.wait()
        self.host_params.before_access = None
        self._worker.shutdown(wait=True)
