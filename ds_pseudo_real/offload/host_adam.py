"""The host side of an optimizer step: DeepSpeed's CPU Adam kernel over host fp32 masters, moments and gradient
buffers, and the device<->host copies of what it steps, pipelined in bounded batches.

Owns: the host masters (a separate fp32 copy, or the host params themselves at host_params in fp32), the host
gradient buffers, the kernel instance and its bias-correction state, the copy streams. Must not hold param groups,
plan, or touch the engine. Written against DeepSpeed 0.19.8's cpu_adam op (``ds_opt_adam.adam_update``, ``opt_id``).
"""
from __future__ import annotations

import contextlib

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ds_pseudo_real import ds_state
from ds_pseudo_real.device import rank_device
from ds_pseudo_real import pinned
from ds_pseudo_real.offload import kernel
from ds_pseudo_real.offload.planner import PlacementLevel

HOST = torch.device("cpu")
# Elements per copy batch: big enough to keep PCIe busy, small enough that the host kernel on one batch runs while
# the next batch is copied (ZeRO 1/2 hand over a layer as one flat partition, possibly of billions of elements).
BATCH_NUMEL = 4 * 2**20
HOST_PARAMS = PlacementLevel.HOST_PARAMS.value


class Batch:
    """Up to :data:`BATCH_NUMEL` elements of one group's params: ``pieces`` are ``(param, start, end)`` ranges of
    each flattened param, copied to the host together and waited for once."""

    def __init__(self, group: Dict[str, Any]):
        self.group = group
        self.pieces: List[Tuple[torch.Tensor, int, int]] = []
        self.numel = 0
        self.copied: Optional[Any] = None  # the event recorded after its copy to the host (CUDA)

    def add(self, p: torch.Tensor, start: int, end: int) -> None:
        self.pieces.append((p, start, end))
        self.numel += end - start

    @property
    def name(self) -> str:
        return str(self.group.get("placement"))


def batches(groups: Sequence[Dict[str, Any]], batch_numel: int) -> List[Batch]:
    """The params of ``groups`` that have a gradient, cut into batches of at most ``batch_numel`` elements, a
    group's params never sharing a batch with another group's, in order."""
    out = []
    for group in groups:
        batch = Batch(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            start = 0
            while start < p.numel():
                end = min(p.numel(), start + batch_numel - batch.numel)
                batch.add(p, start, end)
                start = end
                if batch.numel == batch_numel:
                    out.append(batch)
                    batch = Batch(group)
        if batch.pieces:
            out.append(batch)
    return out


class HostAdam:
    """Adam(W) on the host with DeepSpeed's CPU kernel, for the groups a plan steps there.

    A step of param groups whose params (and gradients) may be on the device is two calls: :meth:`copy_gradients`
    issues the copies of every batch of their gradients to host buffers at once (on a side stream on CUDA), and
    :meth:`step_batches` waits for each batch in turn, steps it and copies its masters back to the params on a
    second stream, so that the kernel on one batch overlaps the copies of the next ones and the host waits once per
    batch, never per parameter. The caller queues device work between the two. ``trace`` (a list,
    or None) records ``(operation, group placement)`` in the order they are issued.
    ``device``: the rank's device, where the params and gradients it copies live and its streams are (default:
    :func:`ds_pseudo_real.device.rank_device`).
    """

    def __init__(self, lr: float, betas, eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool,
                 pin_memory: bool, host_params=None, batch_numel: int = BATCH_NUMEL, groups: Sequence[Dict] = (),
                 device: Optional[torch.device] = None, without_gil: bool = False):
        self.device = device or rank_device()  # where the params and gradients it copies live
        self.cuda = self.device.type == "cuda"
        # the optimizer's group dicts: ZeRO 1/2 rewrite their params in place, so buffers are laid out at first use
        self._groups = list(groups)
        self._where: Dict[torch.Tensor, Tuple[Dict[str, Any], int]] = {}  # param -> (its group, offset in it)
        self._flat: Dict[Tuple[int, str], torch.Tensor] = {}  # (id of group, kind) -> the group's flat buffer
        self.pin = pin_memory and self.cuda
        self.host_params = host_params
        self.batch_numel = batch_numel
        # The CPU Adam object only owns a kernel instance (opt_id, adamw mode); its own param list stays a dummy.
        # ``without_gil``: the same kernel through this package's binding, which a worker thread calls while the
        # training thread runs Python (``offload.kernel``)
        self._kernel_args = (lr, betas, eps, weight_decay, adamw_mode, bias_correction)
        self._cpu_adam = kernel.cpu_adam(*self._kernel_args, without_gil)
        if not without_gil:
            ds_state.check_cpu_adam(self._cpu_adam, "granular_offload")
        self.to_host_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.to_device_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.masters: Dict[torch.Tensor, torch.Tensor] = {}
        self.grad_buffers: Dict[torch.Tensor, torch.Tensor] = {}
        self._stale_masters: set = set()
        # host_params in fp32: the master a host buffer of its own, not the host params (host_step "delayed")
        self.separate_masters = False
        self.trace: Optional[List[Tuple[str, str]]] = None

    def buffer(self, p: torch.Tensor, kind: str, filled: bool = True) -> torch.Tensor:
        """p's range, shaped like p, of the host fp32 buffer of ``kind`` (``grad``, ``master``, ``exp_avg``,
        ``exp_avg_sq``, ``staging``) of p's group: one flat allocation per group and kind (pinned on CUDA, at its
        exact size: ``pinned.host_empty``), as the planner counts them. Zeros when first allocated (unfilled with
        ``filled=False``, for a caller that writes all of it); after that it holds what was written to it."""
        if p not in self._where:
            self._locate()
        if p not in self._where:  # a param of no group this optimizer was given
            return pinned.host_empty(p.shape, torch.float32, self.pin).zero_()
        group, offset = self._where[p]
        flat = self._flat.get((id(group), kind))
        if flat is None:
            numel = sum(q.numel() for q in group["params"])
            flat = self._flat[(id(group), kind)] = (
                pinned.host_empty(numel, torch.float32, self.pin).zero_() if filled
                else ds_state.moments.unfilled(numel, HOST, pin_memory=self.pin))
        return flat[offset:offset + p.numel()].view(p.shape)

    def allocated_bytes(self, group: Dict[str, Any], kind: str) -> int:
        """Bytes of ``group``'s flat host buffer of ``kind`` (0 while it is not allocated)."""
        flat = self._flat.get((id(group), kind))
        return 0 if flat is None else flat.numel() * flat.element_size()

    def _locate(self) -> None:
        for group in self._groups:
            offset = 0
            for q in group["params"]:
                self._where[q] = (group, offset)
                offset += q.numel()

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        buffer = self.grad_buffers.get(p)
        if buffer is None:
            buffer = self.grad_buffers[p] = self.buffer(p, "grad")
        return buffer

    def _log(self, operation: str, batch: Batch) -> None:
        if self.trace is not None:
            self.trace.append((operation, batch.name))

    # ----- masters -------------------------------------------------------------------------------------------
    def master(self, p: torch.Tensor, level: str) -> torch.Tensor:
        """The host fp32 master of ``p``: the host params themselves at host_params in fp32 (unless
        ``separate_masters``), else a host copy (of the params, or of the bf16 host params)."""
        if level == HOST_PARAMS and not self.separate_masters:
            host = self.host_params.host_tensor(p)
            if host.dtype == torch.float32:
                return host
        master = self.masters.get(p)
        fresh = master is None
        if fresh:
            master = self.masters[p] = self.buffer(p, "master")
        if fresh or p in self._stale_masters:  # the only reads of the params (a delayed step may be writing them)
            source = self.host_params.host_tensor(p) if level == HOST_PARAMS else p
            master.copy_(source.detach())
            self._stale_masters.discard(p)
        return master

    def stale(self, p: torch.Tensor) -> bool:
        return p in self._stale_masters

    def set_master(self, p: torch.Tensor, level: str, value: torch.Tensor) -> None:
        self.master(p, level).copy_(value)
        self._stale_masters.discard(p)

    def refresh_masters(self) -> None:
        """Re-read the host masters from the params at the next step (the params were written outside the
        optimizer: a checkpoint loaded without optimizer states, a delink copying weights)."""
        self._stale_masters = set(self.masters)

    # ----- the kernel ----------------------------------------------------------------------------------------
    def adam_update(self, group: Dict[str, Any], step: int, param: torch.Tensor, grad: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, instance=None) -> None:
        """DeepSpeed's CPU Adam kernel at ``step``, in place on host fp32 tensors (or equal ranges of them), on
        ``instance`` (:meth:`kernel_instance`) or this object's own."""
        beta1, beta2 = group["betas"]
        cpu_adam = instance or self._cpu_adam
        cpu_adam.ds_opt_adam.adam_update(cpu_adam.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                         group["weight_decay"], group["bias_correction"], param, grad, exp_avg,
                                         exp_avg_sq)

    def kernel_instance(self):
        """A kernel instance of its own (GIL-free), with this object's hyperparameters: for a thread stepping at
        other step numbers or learning rates than this one's at the same time (each instance keeps the last step
        and its bias corrections)."""
        return kernel.cpu_adam(*self._kernel_args, without_gil=True)

    def state(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` (p's optimizer state), given zero host moments and step 0 at p's first step."""
        if not state:
            state.update(step=0, exp_avg=self.buffer(p, "exp_avg").zero_(), exp_avg_sq=self.buffer(p, "exp_avg_sq").zero_())
        return state

    def replay_kernel_steps(self, last_step: int, group: Dict[str, Any]) -> None:
        """Bring the kernel's bias-correction state to where an uninterrupted run would have it.

        The kernel (DeepSpeed 0.19.8 ``Adam_Optimizer::IncrementStep``) multiplies beta^t by beta once per new
        step, but recomputes it with pow() after a jump (a resume), which differs in the last bit and makes a
        resumed run leave the uninterrupted trajectory. Replaying steps 1..last_step with lr 0 on a one-element
        dummy reproduces the product exactly.
        """
        ds_state.replay_kernel_steps(self._cpu_adam, last_step, group)

    # ----- the pipelined step --------------------------------------------------------------------------------
    def copy_gradients(self, groups: Sequence[Dict[str, Any]], moved: Callable[[Dict[str, Any], int], None]
                       ) -> List[Batch]:
        """First half of a step of ``groups`` (at host_optimizer or host_params): issue the copies of every batch of
        their gradients to the host buffers, all at once (on a side stream on CUDA, after the work queued so far,
        which completes the gradients). ``moved(group, bytes)`` counts what crosses between device and host."""
        work = batches(groups, self.batch_numel)
        if self.cuda:
            self.to_host_stream.wait_stream(torch.cuda.current_stream(self.device))
        for batch in work:
            self._copy_gradients(batch, moved)
        return work

    def step_batches(self, work: List[Batch], state_of: Callable[[torch.Tensor], Dict[str, Any]],
                     moved: Callable[[Dict[str, Any], int], None]) -> None:
        """Second half: wait for each batch in turn, step it and copy its masters back to the params (a second
        stream on CUDA), so the kernel on one batch runs while the next ones are still being copied. ``state_of(p)``
        gives p's optimizer state (moments created here on the host at p's first step)."""
        if self.cuda:
            self.to_device_stream.wait_stream(torch.cuda.current_stream(self.device))  # nothing may still read params
        counted = set()
        for batch in work:
            if batch.copied is not None:
                batch.copied.synchronize()
            self._log("wait", batch)
            level = batch.group["level"]
            for p, start, end in batch.pieces:
                state = self.state(p, state_of(p))
                if p not in counted:  # once per step, whatever the ranges p is cut into
                    counted.add(p)
                    state["step"] += 1
                self.adam_update(batch.group, state["step"], *(t.view(-1)[start:end] for t in (
                    self.master(p, level), self.grad_buffers[p], state["exp_avg"], state["exp_avg_sq"])))
            self._log("adam", batch)
            if level != HOST_PARAMS:  # at host_params the host params are the master: the next fetch carries it
                self._copy_masters_back(batch, moved)
        if self.cuda:
            # ZeRO copies the fp32 partition into the working params right after step() returns
            torch.cuda.current_stream(self.device).wait_stream(self.to_device_stream)

    def _copy_gradients(self, batch: Batch, moved) -> None:
        cuda = any(p.grad.is_cuda for p, _, _ in batch.pieces)
        with torch.cuda.stream(self.to_host_stream) if cuda else contextlib.nullcontext():
            for p, start, end in batch.pieces:
                self.grad_buffer(p).view(-1)[start:end].copy_(p.grad.view(-1)[start:end], non_blocking=cuda)
            if cuda:
                batch.copied = torch.cuda.Event()
                batch.copied.record(self.to_host_stream)
        moved(batch.group, batch.numel * 4)
        self._log("copy to host", batch)

    def _copy_masters_back(self, batch: Batch, moved) -> None:
        cuda = any(p.is_cuda for p, _, _ in batch.pieces)
        with torch.cuda.stream(self.to_device_stream) if cuda else contextlib.nullcontext():
            for p, start, end in batch.pieces:
                p.data.view(-1)[start:end].copy_(self.masters[p].view(-1)[start:end], non_blocking=cuda)
        moved(batch.group, batch.numel * 4)
        self._log("copy to device", batch)

