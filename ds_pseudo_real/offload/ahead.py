"""The host step during the backward (``granular_offload.host_step: "overlapped"``): each own group (host_params
outside DeepSpeed's optimizer) is stepped on the host by a worker thread as soon as its last gradient of the
optimizer step is there, while the backward goes on for the layers before it, and the step is validated when it
comes.

Owns: the worker, which groups were stepped ahead this optimizer step and with what, the copies that undo them
(backups) and how many gradient flushes a group gets in one backward. Must not reduce or copy gradients (that is
``gradients``), plan, or touch the engine. Exact: a group stepped ahead goes through the same kernel calls, on the
same values, as :meth:`GranularOffloadOptimizer._own_step` would make at the step (DeepSpeed 0.19.8's CPU Adam: its
bias correction moves once per new step number, whatever the order of the calls within a step; a parameter cut in
ranges at multiples of :data:`SLICE_NUMEL` runs the same vector code on every element as the whole parameter).

What is assumed ahead, and checked at the step:
  - the gradient factor is ``1 / loss scale`` (no clipping): the global norm is known only when the backward ends.
    When it clips, or the learning rate or betas differ from what was used, the groups are restored from their
    backups and stepped again at the step (``redone``), and the next step is left sequential (``held``): it is
    stepped ahead again after a step whose factor was the assumed one (a norm that clips every step costs one redo,
    not one per step). When DeepSpeed skips the step (an inf or NaN gradient, an
    fp16 overflow) they are restored when it drops the gradients. Backups (fp32 master, moments and, in 16 bits, the
    host params: 12 to 14 bytes a parameter on the host) are kept only when the step may be refused: gradient
    clipping on, or fp16; otherwise the assumed factor is the factor, and nothing is copied.
  - a group's gradient is complete after as many flushes in the last micro-batch's backward as it got in the
    previous optimizer step's (one for a layer run once; more with reentrant activation checkpointing or a layer
    set shared in several graph tasks). The first step is learnt, not stepped ahead. A flush of a group after its
    host step raises: the backward would have read parameters already stepped.

The worker calls the kernel through this package's op (``offload.kernel``), which releases the GIL while it steps,
so the training thread runs its Python (hooks, the next layer's launches) meanwhile. It still steps every parameter
in ranges of :data:`SLICE_NUMEL`, taking the GIL back between them.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ds_pseudo_real.offload.host_adam import HOST_PARAMS, HostAdam

SLICE_NUMEL = 2**20  # a multiple of every SIMD tile of the CPU Adam kernel (AVX-512 x 8 = 128 elements)
_SCHEDULED_KEYS = ("lr", "betas")


class _Backup:
    """What one parameter's host step changes, as it was before it: its step count, fp32 master, moments and (in 16
    bits) its host params."""

    def __init__(self, step: int, tensors: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.step = step
        self.tensors = tensors  # (the live tensor, its copy)


class HostStepAhead:
    """Steps own groups ahead of the optimizer step, in a worker thread (see the module docstring).

    ``host``: the optimizer's :class:`HostAdam`; ``host_params``: its ``HostParamStore``; ``state_of(p)``: p's
    optimizer state. :attr:`boundary` (the engine's ``is_gradient_accumulation_boundary``), :attr:`loss_scale` and
    :attr:`keep_backups` are set by ``attach_to_engine``; until then nothing is stepped ahead. ``scheduled()``
    gives the param group whose ``lr`` and ``betas`` the schedulers set.
    """

    def __init__(self, host: HostAdam, host_params, state_of: Callable[[torch.Tensor], Dict[str, Any]],
                 scheduled: Callable[[], Dict[str, Any]]):
        self.host = host
        self.host_params = host_params
        self.state_of = state_of
        self.scheduled = scheduled
        self.boundary: Optional[Callable[[], bool]] = None
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.keep_backups = True
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="host step ahead")
        self._futures: List[concurrent.futures.Future] = []
        self._flushes: Dict[int, int] = {}  # group id -> flushes in this optimizer step's last backward
        self._expected: Dict[int, int] = {}  # ... in the previous optimizer step's
        self._ahead: Dict[int, Tuple[float, Tuple]] = {}  # group id -> (factor, scheduled values) it was stepped with
        self._assumed: Optional[Tuple[float, Tuple]] = None  # (factor, values) a step ahead would use in this step
        self._hold = False  # the last step refused what was assumed: this one is sequential
        self._backups: Dict[torch.Tensor, _Backup] = {}
        # param -> the squared L2 norm of its accumulated gradient this step (a flush that added staged gradients:
        # the one-flush ones are taken on the device, ``OwnGradients``), taken by the worker while the buffer is
        # fresh in its cache (``OwnGradients.norm`` reads it instead of the buffer: the same value)
        self.squares: Dict[torch.Tensor, torch.Tensor] = {}
        self._copies: Dict[Tuple[int, str], torch.Tensor] = {}  # (group id, kind) -> flat backup buffer
        self.stepped_ahead = 0  # groups stepped ahead since construction
        self.redone = 0  # ... of them restored and stepped again at the step
        self.undone = 0  # ... restored for a skipped step
        self.held = 0  # optimizer steps left sequential because the step before refused the assumed factor

    # ----- during the backward -------------------------------------------------------------------------------
    def take(self, group: Dict[str, Any], flush) -> bool:
        """Called for every gradient flush of ``group`` (``gradients._Flush``, already issued): True when the worker
        takes it (waits for its copy, adds what it staged, steps the group), False to leave it to the step."""
        if self.boundary is None or not self.boundary():
            return False
        key = id(group)
        if key in self._ahead:
            raise RuntimeError(f"granular_offload.host_step 'overlapped': group {group.get('placement')!r} got a "
                               f"gradient after its host step, so this backward ran on parameters already stepped; "
                               f"the layer runs in more graph tasks than in the previous step. Use host_step "
                               f"'sequential' for this model")
        self._flushes[key] = self._flushes.get(key, 0) + 1
        if self._expected.get(key) != self._flushes[key] or len(flush.params) != len(group["params"]):
            return False
        factor = 1.0 / float(self.loss_scale())
        scheduled = self.scheduled()
        values = tuple(scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled)
        self._assumed = (factor, values)
        if self._hold:
            return False
        group.update({k: scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled})
        self._ahead[key] = (factor, values)
        self._futures.append(self._worker.submit(self._step, group, flush, factor))
        return True

    @torch.no_grad()
    def _step(self, group: Dict[str, Any], flush, factor: float) -> None:
        if flush.event is not None:
            flush.event.synchronize()
        for p, staged in flush.staged.items():
            self.host.grad_buffers[p].add_(staged)
        for p in flush.staged:
            self.squares[p] = torch.linalg.vector_norm(self.host.grad_buffers[p]).pow(2)
        for p in group["params"]:
            state = self.host.state(p, self.state_of(p))
            master = self.host.master(p, HOST_PARAMS)
            host = self.host_params.host_tensor(p)
            if self.keep_backups:
                self._back_up(group, p, state, master, host)
            state["step"] += 1
            step_param(self.host, group, state, master, self.host.grad_buffers[p], factor)
            if master is not host:
                host.copy_(master)  # 16 bits: round the master into the host params
        self.stepped_ahead += 1

    def _back_up(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any], master: torch.Tensor,
                 host: torch.Tensor) -> None:
        live = [("master", master), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])]
        if host is not master:
            live.append(("host", host))
        pairs = []
        for kind, tensor in live:
            copy = self._copy_buffer(group, p, kind, tensor.dtype)
            copy.copy_(tensor.reshape(-1))
            pairs.append((tensor, copy))
        self._backups[p] = _Backup(state["step"], pairs)

    def reserve_backups(self, groups: List[Dict[str, Any]]) -> None:
        """Allocate the backup buffers of ``groups`` now (the plan counts them, ``planner.backup_buffers``): a host
        short of memory refuses at the start, not at the first step ahead."""
        for group in groups:
            for p in group["params"]:
                host = self.host_params.host_tensor(p)
                kinds = ["master", "exp_avg", "exp_avg_sq"] + (["host"] if host.dtype != torch.float32 else [])
                for kind in kinds:
                    self._copy_buffer(group, p, kind, host.dtype if kind == "host" else torch.float32)

    def backup_bytes(self, group: Dict[str, Any]) -> int:
        """Host bytes of ``group``'s backup buffers."""
        return sum(t.numel() * t.element_size() for (key, _), t in self._copies.items() if key == id(group))

    def _copy_buffer(self, group: Dict[str, Any], p: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """p's range of the group's flat backup buffer of ``kind`` (one host allocation per group and kind)."""
        flat = self._copies.get((id(group), kind))
        if flat is None:
            flat = self._copies[(id(group), kind)] = torch.empty(sum(q.numel() for q in group["params"]), dtype=dtype)
        offset = 0
        for q in group["params"]:
            if q is p:
                return flat[offset:offset + p.numel()]
            offset += q.numel()
        raise KeyError("parameter of another group")

    def wait(self) -> None:
        """Until the worker has done everything it was given (raising what it raised)."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    # ----- at the step ---------------------------------------------------------------------------------------
    def accept(self, factor: float, scheduled: Dict[str, Any], groups: List[Dict[str, Any]]) -> Set[int]:
        """At the step, with the gradient factor it uses: the ids of the ``groups`` stepped ahead with that factor
        and the same ``lr``/``betas``, now final; the others stepped ahead are restored, to be stepped again."""
        self.wait()
        values = tuple(scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled)
        self.held += self._hold and self._assumed is not None
        if self._assumed is not None:  # the next step is stepped ahead only if this one took what it would assume
            self._hold = self._assumed != (factor, values)
        done = set()
        for group in groups:
            ahead = self._ahead.get(id(group))
            if ahead is None:
                continue
            if ahead == (factor, values):
                done.add(id(group))
            else:
                self._restore(group)
                self.redone += 1
        self._end_of_step()
        return done

    def discard(self, groups: List[Dict[str, Any]]) -> None:
        """The step was skipped (DeepSpeed drops the gradients without a step): groups stepped ahead are restored."""
        self.wait()
        for group in groups:
            if id(group) in self._ahead:
                self._restore(group)
                self.undone += 1
        self._end_of_step()

    def _restore(self, group: Dict[str, Any]) -> None:
        if not self.keep_backups:
            raise RuntimeError(f"granular_offload.host_step 'overlapped': group {group.get('placement')!r} was "
                               f"stepped ahead without a backup, and the step refused it (no gradient clipping and "
                               f"no fp16 was assumed)")
        for p in group["params"]:
            backup = self._backups.pop(p)
            for tensor, copy in backup.tensors:
                tensor.view(-1).copy_(copy)
            self.state_of(p)["step"] = backup.step

    def _end_of_step(self) -> None:
        self.squares.clear()
        if self._flushes:
            self._expected = dict(self._flushes)
        self._flushes.clear()
        self._assumed = None
        self._ahead.clear()
        self._backups.clear()

    def shutdown(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)


def step_param(host: HostAdam, group: Dict[str, Any], state: Dict[str, Any], master: torch.Tensor,
               grad: torch.Tensor, factor: float, step: Optional[int] = None, instance=None) -> None:
    """One parameter's kernel step at ``step`` (default ``state["step"]``), with its gradient multiplied by
    ``factor`` (out of place: the gradient buffer keeps the gradient), in ranges of :data:`SLICE_NUMEL` elements;
    ``instance``: a kernel instance other than ``host``'s own (``HostAdam.kernel_instance``)."""
    step = state["step"] if step is None else step
    flat = [t.view(-1) for t in (master, grad, state["exp_avg"], state["exp_avg_sq"])]
    for start in range(0, flat[0].numel(), SLICE_NUMEL):
        m, g, avg, avg_sq = (t[start:start + SLICE_NUMEL] for t in flat)
        host.adam_update(group, step, m, g if factor == 1.0 else g * factor, avg, avg_sq, instance)
