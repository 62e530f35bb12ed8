"""The host step one optimizer step late (``granular_offload.host_step: "delayed"``, ZeRO-Offload's delayed parameter
update): the own groups' host step of optimizer step t runs in a worker thread during the forward and backward of
step t + 1, and its result reaches the host params (what the layers fetch) at step t + 1's optimizer step. A change
of the math, opt-in: the gradient of step t + 1 is taken at the params before step t's update.

Owns: the worker, the second gradient buffer each own param's delayed step reads while the next backward fills the
first, and publishing a finished step into the host params. Must not reduce or copy gradients (``gradients``), plan,
or touch the engine.

What it keeps exact: the delayed step is the sequential step's kernel calls on step t's gradients, with step t's
gradient factor (loss scale and clipping), learning rate and betas. The fp32 master is a host buffer of its own
(in fp32 too, where the sequential step steps the host params themselves), so the worker never writes what a fetch
reads. The first ``from_step`` optimizer steps are sequential (ZeRO-Offload turns the delay on after its first
steps). A step DeepSpeed skips (an inf or NaN gradient) steps nothing; the update in flight is published at the next
step. A checkpoint waits for the step in flight: it holds the host params as published (what the next forward reads)
and the fp32 master with the update applied, so a resumed run publishes it at its first step, as the run it resumes
would have.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

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
        self._future: Optional[concurrent.futures.Future] = None
        self._spare: Dict[torch.Tensor, torch.Tensor] = {}  # param -> the gradient buffer not being filled
        self.delayed = 0  # optimizer steps whose own-group step ran late
        self.published = 0  # own-group steps published into the host params

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
        """Step ``groups`` with this step's gradients, times ``factor``, in the worker. Their gradient buffers are
        swapped with the spare ones first, so the next backward fills the others."""
        self.wait()
        work: List[Tuple[Dict[str, Any], Dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group in groups:
            for p in group["params"]:
                state = self.host.state(p, self.state_of(p))
                master = self.host.master(p, HOST_PARAMS)
                filled = self.host.grad_buffers[p]
                self.host.grad_buffers[p], self._spare[p] = self._spare_buffer(p), filled
                state["step"] += 1
                work.append((group, state, master, filled))
        if work:  # this thread steps DeepSpeed's groups at the same step number meanwhile, with the same kernel
            self.host.enter_step(work[0][0], work[0][1]["step"])
        self._future = self._worker.submit(self._step, work, factor)
        self.delayed += 1

    @torch.no_grad()
    def _step(self, work, factor: float) -> None:
        for group, state, master, grad in work:
            step_param(self.host, group, state, master, grad, factor)

    def wait(self) -> None:
        """Until the step in flight is done (raising what it raised)."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    @torch.no_grad()
    def publish(self, groups: List[Dict[str, Any]]) -> None:
        """Wait for the step in flight and write the masters into the host params (rounded in 16 bits). Before any
        layer is fetched again: the optimizer step releases every fetched copy first."""
        self.wait()
        for group in groups:
            for p in group["params"]:
                self.host_params.host_tensor(p).copy_(self.host.master(p, HOST_PARAMS))
        self.published += 1

    def shutdown(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)
