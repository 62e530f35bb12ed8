"""GranularOffloadOptimizer: Adam(W) whose parameter groups are stepped where the plan placed them.

Owns: the client optimizer handed to ``deepspeed.initialize``: its param groups and optimizer state, the dispatch
of each group to its level and the byte accounting. The host step is :class:`HostAdam`'s (host_adam), the own
groups' gradients :class:`OwnGradients`' (gradients), host-resident params the ``HostParamStore``'s (params), where
each state lives and the checkpoints ``optimizer_state``'s. Must not plan (``planner``) or touch the engine
(``ds_pseudo_real.offload.attach_to_engine``). Written against DeepSpeed 0.19.8: ZeRO 1/2 and the bf16 optimizer
rewrite each group's ``params`` in place to one flat fp32 partition and swap ``param_groups`` to a single group
during ``step``, so every step reads the live group dicts and every state lives in ``self.state`` keyed by the
group's own params (an inner optimizer with its own param lists would silently never update the weights).

Group keys: ``placement`` (the plan's group name, ``layer3``, ``layer3.experts``, ``other``) and ``level``; expert
groups also carry DeepSpeed's MoE keys ``moe: True`` and ``name`` (the DeepSpeed expert group, e.g. ``ep_size_2``),
which is why the plan's name is not kept under ``name``.

Levels (``group["level"]``):
  device          Adam on the params' own device, in place (on CPU: DeepSpeed's CPU Adam kernel; on CUDA: torch's
                  fused Adam, see ``_fused_device_adam`` for why not apex's).
  host_optimizer  the fp32 master and the moments live on the host; each step copies the gradient to the host,
                  runs DeepSpeed's CPU Adam kernel there and copies the master back, pipelined in batches (pinned
                  buffers and two side streams on CUDA) so that the kernel on one batch overlaps the copies of
                  the next.
  host_params     as host_optimizer, but the working params live on the host too (``HostParamStore``), so the
                  host copy of the params is the master and nothing is copied back.

Under ZeRO 1/2 and bf16 DeepSpeed keeps every group of its optimizer in (flat) device copies, so host_params
groups are given as ``own_groups`` instead: kept out of ``param_groups`` (DeepSpeed's optimizer never sees them)
and stepped on the host, every param of them (with a zero gradient when it got none, as DeepSpeed does), by the
first ``step()`` call of an optimizer step (ZeRO calls it once per group); in bf16 a separate fp32 master is kept
there and rounded into the host params. With ``stream_gradients`` (ZeRO 1/2) their gradients are reduced over the
data-parallel ranks and copied to host buffers a layer at a time during the backward; without it (ZeRO 0, whose
engine all-reduces every gradient of the model itself) they are copied to the host when the step begins. With
streamed gradients ``host_step`` says when their host step runs: at the step (``sequential``), during the backward
(``overlapped``: :class:`~ds_pseudo_real.offload.ahead.HostStepAhead`) or one step late, during the next forward and
backward (``delayed``: :class:`~ds_pseudo_real.offload.delayed.DelayedHostStep`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from ds_pseudo_real import ds_state
from ds_pseudo_real.device import rank_device
from ds_pseudo_real.offload import optimizer_state
from ds_pseudo_real.offload.ahead import HostStepAhead, step_param
from ds_pseudo_real.offload.delayed import SPARE_GRADIENT, DelayedHostStep
from ds_pseudo_real.offload.gradients import OwnGradients
from ds_pseudo_real.offload.host_adam import BATCH_NUMEL, HOST, HOST_PARAMS, HostAdam
from ds_pseudo_real.offload.optimizer_state import OWN_GROUPS_KEY, place_state, steps_on_device
from ds_pseudo_real.offload.planner import PlacementLevel

_SCHEDULED_KEYS = ("lr", "betas")  # what LR/momentum schedulers set on param_groups: own groups follow them
SEQUENTIAL, OVERLAPPED, DELAYED = "sequential", "overlapped", "delayed"
HOST_STEPS = (SEQUENTIAL, OVERLAPPED, DELAYED)  # granular_offload.host_step: when the own groups' host step runs


def _fused_device_adam(params: List[torch.nn.Parameter], adamw_mode: bool, defaults: Dict[str, Any]):
    """torch's fused CUDA Adam(W). Not apex's FusedAdam: apex counts steps in the param group, which this wrapper
    rebuilds per step and DeepSpeed does not checkpoint, so a resume would restart its bias correction. torch's
    always corrects the bias: ``bias_correction=False`` is refused with device groups on CUDA (``__init__``)."""
    hyper = {k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, fused=True, **hyper)


class GranularOffloadOptimizer(torch.optim.Optimizer):
    """Adam(W) over parameter groups that each carry ``placement`` and ``level`` (a :class:`PlacementLevel` value);
    expert groups also carry DeepSpeed's ``moe`` and ``name``.

    ``adamw_mode`` True: decoupled weight decay (AdamW); False: L2 added to the gradient (Adam), as DeepSpeed's
    ``adam_w_mode``. ``host_params`` is the :class:`~ds_pseudo_real.offload.params.HostParamStore` of the model when
    any group is at ``host_params``. ``own_groups``: host_params groups this optimizer reduces (averaged over
    ``reduce_group``, DeepSpeed's data-parallel group, which ``attach_to_engine`` sets; experts summed over their
    expert-data-parallel group) and steps itself, outside ``param_groups`` (see the module docstring).
    ``batch_numel``: elements per pipelined host copy batch (:class:`~ds_pseudo_real.offload.host_adam.HostAdam`).
    ``device``: the rank's device, where its device groups and gradients live (default:
    :func:`ds_pseudo_real.device.rank_device`, never the current device, which DeepSpeed sets only later).
    """

    def __init__(self, param_groups: Iterable[Dict[str, Any]], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
                 pin_memory: bool = True, host_params=None, own_groups: Iterable[Dict[str, Any]] = (),
                 reduce_group=None, stream_gradients: bool = True, clip_grad: float = 0.0,
                 batch_numel: int = BATCH_NUMEL, device: Optional[torch.device] = None,
                 host_step: str = SEQUENTIAL, delayed_from_step: int = 0):
        groups = [dict(g) for g in param_groups]
        for g in groups:
            g["level"] = PlacementLevel(g.get("level", PlacementLevel.DEVICE)).value
        device = device or rank_device()
        device_groups = [g.get("placement") for g in groups if g["level"] == PlacementLevel.DEVICE.value]
        if not bias_correction and device_groups and device.type == "cuda":
            raise ValueError(f"optimizer.params.bias_correction: got False, but granular_offload steps the groups at "
                             f"'device' on CUDA with torch's fused Adam, which always corrects the bias (groups: "
                             f"{device_groups}); accepted: true (the default), or no group at 'device'")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, placement=None, level=PlacementLevel.DEVICE.value)
        super().__init__(groups, defaults)
        self.own_param_groups = [{**defaults, **g, "params": list(g["params"]), "level": HOST_PARAMS}
                                 for g in own_groups]
        if self.own_param_groups and host_params is None:
            raise ValueError("own_groups are host_params groups: pass the HostParamStore serving them as host_params")
        self.own_state: Dict[torch.Tensor, Dict[str, Any]] = {}
        self.adamw_mode = adamw_mode
        self.host_params = host_params
        if host_step not in HOST_STEPS:
            raise ValueError(f"host_step: got {host_step!r}; accepted: {list(HOST_STEPS)}")
        overlapped = host_step == OVERLAPPED and bool(self.own_param_groups) and stream_gradients
        delayed = host_step == DELAYED and bool(self.own_param_groups) and stream_gradients
        self.host = HostAdam(lr, betas, eps, weight_decay, adamw_mode, bias_correction, pin_memory, host_params,
                             batch_numel, groups=self.param_groups + self.own_param_groups, device=device,
                             without_gil=overlapped or delayed)
        self.host.separate_masters = delayed
        self.own_gradients = OwnGradients(self.own_param_groups, self.host, stream_gradients)
        self.own_gradients.reduce_group = reduce_group
        self.own_gradients.moved = self._count_moved
        # the own groups stepped during the backward (``ahead``); it needs gradients streamed as autograd ends them
        self.ahead = (HostStepAhead(self.host, host_params, self.state_of, lambda: self.param_groups[0])
                      if overlapped else None)
        self.own_gradients.ahead = self.ahead
        # the own groups stepped one optimizer step late, during the next forward and backward (``delayed``)
        self.delayed = (DelayedHostStep(self.host, host_params, self.state_of, delayed_from_step)
                        if delayed else None)
        self._own_stepped = False  # this optimizer step's own-group step is done (ZeRO 1/2 call step() per group)
        self.clip_grad = clip_grad
        # set by ``ds_state.include_in_gradient_norm``: this step's (global norm, loss scale), own gradients included
        self.global_grad_norm: Optional[Callable[[], Any]] = None
        self._device_adam = None  # built on the first CUDA device group
        # since construction; ZeRO 1/2 call step() once per group, so callers take differences
        self.moved_bytes = 0
        self.moved_bytes_by_group: Dict[str, int] = {}  # the same, per ``placement``

    # ----- what attach_to_engine sets ------------------------------------------------------------------------
    @property
    def reduce_group(self):
        return self.own_gradients.reduce_group

    @reduce_group.setter
    def reduce_group(self, group) -> None:
        self.own_gradients.reduce_group = group

    @property
    def communication_dtype(self) -> Optional[torch.dtype]:
        return self.own_gradients.communication_dtype

    @communication_dtype.setter
    def communication_dtype(self, dtype: Optional[torch.dtype]) -> None:
        self.own_gradients.communication_dtype = dtype

    @property
    def peak_streamed_gradient_bytes(self) -> int:
        """The most own-group gradient bytes held on the device by one flush to the host."""
        return self.own_gradients.peak_device_bytes

    # ----- state ---------------------------------------------------------------------------------------------
    def fp32_master(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 value this optimizer steps for an own-group param ``p`` (None for any other param)."""
        if p not in self.own_gradients.params:
            return None
        return self.host.master(p, HOST_PARAMS)

    def state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        """The optimizer state of ``p``: own-group states live outside ``self.state``, which torch's
        ``state_dict`` packs by ``param_groups`` alone."""
        return self.own_state.setdefault(p, {}) if p in self.own_gradients.params else self.state[p]

    def seed_states(self, step: Any, unwritten: ds_state.UnwrittenMoments) -> None:
        """Moments and the step count ``step`` (an int or a tensor) for every param, placed where this plan steps
        them, as a loaded checkpoint's (:func:`~ds_pseudo_real.offload.optimizer_state.place_state`), and the CPU
        kernel's bias correction brought to ``step``: the state a delink writes the carried moments into. The
        moments are left unfilled and recorded in ``unwritten``, for the delink to write once and zero what it did
        not write. Nothing is allocated on the device for a group the plan steps on the host."""
        step = int(step.item()) if torch.is_tensor(step) else int(step)
        for group in self.param_groups + self.own_param_groups:
            for p in group["params"]:
                state = self.state_of(p)
                state.clear()
                state["step"] = step
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = (ds_state.moments.unfilled(p.shape, p.device)
                                  if steps_on_device(p, group["level"])
                                  else self.host.buffer(p, key, filled=False))
                    unwritten.add(state[key])
                place_state(self.host, state, p, group["level"])
        self.host.replay_kernel_steps(step, self.param_groups[0])

    # ----- step ----------------------------------------------------------------------------------------------
    def _device_step(self, group: Dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        cuda = [p for p in params if p.device.type == "cuda"]
        for p in params:
            if p.device == HOST:
                state = self.host.state(p, self.state[p])
                state["step"] += 1
                self.host.adam_update(group, state["step"], p.data, p.grad.data, state["exp_avg"],
                                      state["exp_avg_sq"])
        if cuda:
            if self._device_adam is None:
                self._device_adam = _fused_device_adam([torch.nn.Parameter(torch.zeros(1, device=self.host.device))],
                                                       self.adamw_mode, self.defaults)
                self._device_adam.state = self.state
            self._device_adam.param_groups = [{**self._device_adam.defaults, **group, "params": cuda}]
            self._device_adam.step()

    def _gradient_factor(self) -> float:
        """The factor DeepSpeed applied to its own gradients this step: 1 / (loss scale x clipping), with the norm of
        the loss-scaled gradients and the scale it divided them by (``ds_state.include_in_gradient_norm``)."""
        norm, scale = self.global_grad_norm()
        combined = float(scale)
        if self.clip_grad > 0.0:
            clip = ((float(norm) / scale) + 1e-6) / self.clip_grad  # DeepSpeed's rule: its norm is norm x scale
            combined = clip * scale if clip > 1.0 else scale
        return 1.0 / combined

    def own_grad_norm(self, sum_model_parallel: bool = True) -> torch.Tensor:
        """L2 norm of the own groups' gradients this step (:meth:`OwnGradients.norm`); a collective with experts
        or model parallelism."""
        return self.own_gradients.norm(sum_model_parallel)

    def _step_own_groups(self) -> None:
        """The own groups' part of ``step()``. Before ``attach_to_engine`` (which also gives this optimizer the
        global gradient norm) only DeepSpeed's stage-0 unfused optimizer steps, with no gradient anywhere, while
        the engine is built: :meth:`zero_gradient_step` replays that step once the host params are adopted."""
        if self.global_grad_norm is not None:
            self._own_step(None)
        elif self.own_gradients.received:
            raise RuntimeError("granular_offload: host_params groups outside DeepSpeed's optimizer (ZeRO >= 1 or bf16) "
                               "are reduced and clipped with the engine's groups: build the engine with "
                               "ds_pseudo_real.initialize, or call ds_pseudo_real.offload.attach_to_engine(engine) "
                               "after deepspeed.initialize")

    def _own_step(self, factor: Optional[float]) -> None:
        """Step every own-group param once per optimizer step, as DeepSpeed steps every param of its groups (a
        param that got no gradient with a zero one), its gradient multiplied by ``factor`` (None: DeepSpeed's
        :meth:`_gradient_factor`); ZeRO's later per-group calls find it done."""
        if self._own_stepped or not self.own_param_groups:
            return
        self.own_gradients.settle()
        factor = self._gradient_factor() if factor is None else factor
        scheduled = self.param_groups[0]
        done = self.ahead.accept(factor, scheduled, self.own_param_groups) if self.ahead is not None else set()
        if self.delayed is not None:
            if self.delayed.delays(self._own_steps_taken()):
                self.delayed.publish(self.own_param_groups)  # the step before's, for the next forward to fetch
                for group in self.own_param_groups:
                    group.update({k: scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled})
                self.delayed.submit(self.own_param_groups, factor)
                self._own_stepped = True
                return
            self.delayed.wait()
        for group in self.own_param_groups:
            if id(group) in done:  # stepped during the backward with this factor
                continue
            group.update({k: scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled})
            for p in group["params"]:
                state = self.host.state(p, self.state_of(p))
                state["step"] += 1
                master = self.host.master(p, HOST_PARAMS)
                step_param(self.host, group, state, master, self.host.grad_buffers[p], factor)
                host = self.host_params.host_tensor(p)
                if master is not host:
                    host.copy_(master)  # bf16: round the master into the host params (no device copy)
        self._own_stepped = True

    def _own_steps_taken(self) -> int:
        first = self.own_param_groups[0]["params"][0]
        return int(self.state_of(first).get("step", 0))

    def zero_gradient_step(self) -> None:
        """One step of the own groups with zero gradients: what DeepSpeed's stage-0 unfused optimizer (bf16 with a
        client optimizer) does to every group it holds when it is built, so that all groups count the same steps
        (and have had the same weight decay)."""
        self._own_step(1.0)
        self.drop_own_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the own groups' gradients dropped too (:meth:`drop_own_gradients`)."""
        super().zero_grad(set_to_none)
        self.drop_own_gradients()

    def drop_own_gradients(self) -> None:
        """Forget the own groups' gradients not stepped yet, on the device and in the host buffers; their weights,
        moments and step counts stay. What DeepSpeed does with its own gradients when it zeroes them, which it
        does after every optimizer step, a skipped one (inf or NaN gradients) included: groups stepped during the
        backward of a skipped step are restored."""
        if self.ahead is not None:
            self.ahead.discard(self.own_param_groups)
        self.own_gradients.drop()
        self._own_stepped = False

    def remove_hooks(self) -> None:
        """Take the gradient-streaming hooks and the host-param fetch hooks off the model (before a delink); a
        delayed step in flight is published first (the delink copies the weights with their moments)."""
        if self.delayed is not None:
            self.delayed.publish(self.own_param_groups)
            self.delayed.shutdown()
        self.own_gradients.remove_hooks()
        if self.host_params is not None:
            self.host_params.remove()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.host_params is not None:
            self.host_params.release_all()  # before the host params are written: no copy fetched before survives
        self._step_own_groups()
        work = self.host.copy_gradients([g for g in self.param_groups if g["level"] != PlacementLevel.DEVICE.value],
                                        self._count_moved)
        for group in self.param_groups:  # device kernels run on the device while the host steps below
            if group["level"] == PlacementLevel.DEVICE.value:
                self._device_step(group)
        self.host.step_batches(work, self.state_of, self._count_moved)
        return loss

    # ----- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict of ``param_groups``, plus the own groups' states and (bf16) fp32 masters in order."""
        if self.delayed is not None:
            self.delayed.wait()  # the masters and moments with the step in flight applied (module docstring)
        out = super().state_dict()
        if self.own_param_groups:
            out[OWN_GROUPS_KEY] = optimizer_state.own_groups_state(self)
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load states saved by any plan with the same host_params groups: the current plan's group keys are kept,
        the states of the groups this plan steps on the host go straight into their host buffers (torch's
        ``Optimizer.load_state_dict`` would first move every state onto its param's device: all the state the plan
        keeps off the device, there at once), and the host masters are re-read from the params (own groups' bf16
        masters, and the fp32 ones of a delayed host step: restored as saved)."""
        if self.delayed is not None:
            self.delayed.wait()
        optimizer_state.load_state_dict(self, state_dict, super().load_state_dict)

    def refresh_host_masters(self) -> None:
        """Re-read the host masters from the params at the next step. Needed after anything writes the params
        outside this optimizer (a checkpoint loaded without optimizer states, a delink copying weights)."""
        self.host.refresh_masters()

    # ----- accounting ----------------------------------------------------------------------------------------
    def _count_moved(self, group: Dict[str, Any], size: int) -> None:
        self.moved_bytes += size
        self.moved_bytes_by_group[group["placement"]] = self.moved_bytes_by_group.get(group["placement"], 0) + size

    def held_bytes(self) -> Dict[str, int]:
        """Bytes this optimizer holds now: ``device`` (moments of device groups) and ``host`` (host masters, gradient
        buffers, staging buffers for later micro-batches, moments of host groups and the overlapped host step's
        backups; at host_params the master is the host params, counted here)."""
        by_group = self.held_bytes_by_group().values()
        return {where: sum(held[where] for held in by_group) for where in ("device", "host")}

    def held_bytes_by_group(self) -> Dict[str, Dict[str, int]]:
        """``held_bytes`` of each group, keyed by its ``placement`` (groups sharing one are summed)."""
        out: Dict[Any, Dict[str, int]] = {}
        for group in self.param_groups + self.own_param_groups:
            held = out.setdefault(group["placement"], {"device": 0, "host": 0})
            where = "device" if group["level"] == PlacementLevel.DEVICE.value else "host"
            for p in group["params"]:
                state = (self.own_state if p in self.own_gradients.params else self.state).get(p) or {}
                held[where] += sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t)
                                   and k in ("exp_avg", "exp_avg_sq"))
                if where == "host":
                    host = (self.host_params.host_tensor(p) if group["level"] == PlacementLevel.HOST_PARAMS.value
                            else None)
                    for tensor in (host, self.host.masters.get(p), self.host.grad_buffers.get(p)):
                        if tensor is not None:
                            held["host"] += tensor.numel() * tensor.element_size()
            held["host"] += sum(self.host.allocated_bytes(group, kind) for kind in ("staging", SPARE_GRADIENT))
            if self.ahead is not None:
                held["host"] += self.ahead.backup_bytes(group)
        return out
