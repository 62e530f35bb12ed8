"""GranularOffloadOptimizer: Adam(W) whose parameter groups are stepped where the plan placed them.

Owns: the client optimizer handed to ``deepspeed.initialize``; host masters and host optimizer state of the
offloaded groups, the copies between device and host, and the byte accounting. Must not plan (``planner``) or
touch the engine. Written against DeepSpeed 0.19.8: ZeRO 1/2 and the bf16 optimizer rewrite each group's
``params`` in place to one flat fp32 partition and swap ``param_groups`` to a single group during ``step``, so
every step reads the live group dicts and every state lives in ``self.state`` keyed by the group's own params
(an inner optimizer with its own param lists would silently never update the weights).

Group keys: ``placement`` (the plan's group name, ``layer3``, ``layer3.experts``, ``other``) and ``level``; expert
groups also carry DeepSpeed's MoE keys ``moe: True`` and ``name`` (the DeepSpeed expert group, e.g. ``ep_size_2``),
which is why the plan's name is not kept under ``name``.

Levels (``group["level"]``):
  device          Adam on the params' own device, in place (on CPU: DeepSpeed's CPU Adam kernel; on CUDA: torch's
                  fused Adam, see ``_fused_device_adam`` for why not apex's).
  host_optimizer  the fp32 master and the moments live on the host; each step copies the gradient to the host,
                  runs DeepSpeed's CPU Adam kernel there and copies the master back. On CUDA the copies use pinned
                  buffers and two side streams so a group's copy overlaps another group's host step.
  host_params     as host_optimizer, but the working params live on the host too (``HostParamStore``), so the
                  host copy of the params is the master and nothing is copied back.

Under ZeRO 1/2 and bf16 DeepSpeed keeps every group of its optimizer in (flat) device copies, so host_params
groups are given as ``own_groups`` instead: kept out of ``param_groups`` (DeepSpeed's optimizer never sees them)
and stepped on the host by the first ``step()`` call of an optimizer step (ZeRO calls it once per group); in
bf16 a separate fp32 master is kept there and rounded into the host params. With ``stream_gradients`` (ZeRO 1/2)
their gradients are reduced over the data-parallel ranks here and streamed to host buffers as soon as autograd
has accumulated them; without it (ZeRO 0, whose engine all-reduces every gradient of the model itself) they are
copied to the host when the step begins.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam

from ds_pseudo_real.offload.planner import PlacementLevel

HOST = torch.device("cpu")
# kept from the current plan when a checkpoint is loaded: ours, and DeepSpeed's MoE keys (checkpoints written
# before expert groups existed hold the plan's group name under "name")
_GROUP_KEYS = ("placement", "level", "moe", "name")
OWN_GROUPS_KEY = "granular_offload_own_groups"  # the own groups' states in ``state_dict()``
_SCHEDULED_KEYS = ("lr", "betas")  # what LR/momentum schedulers set on param_groups: own groups follow them


def _fused_device_adam(params: List[torch.nn.Parameter], adamw_mode: bool, defaults: Dict[str, Any]):
    """torch's fused CUDA Adam(W). Not apex's FusedAdam: apex counts steps in the param group, which this wrapper
    rebuilds per step and DeepSpeed does not checkpoint, so a resume would restart its bias correction."""
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
    """

    def __init__(self, param_groups: Iterable[Dict[str, Any]], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
                 pin_memory: bool = True, host_params=None, own_groups: Iterable[Dict[str, Any]] = (),
                 reduce_group=None, stream_gradients: bool = True, clip_grad: float = 0.0):
        groups = [dict(g) for g in param_groups]
        for g in groups:
            g["level"] = PlacementLevel(g.get("level", PlacementLevel.DEVICE)).value
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, placement=None, level=PlacementLevel.DEVICE.value)
        super().__init__(groups, defaults)
        self.own_param_groups = [{**defaults, **g, "params": list(g["params"]),
                                  "level": PlacementLevel.HOST_PARAMS.value} for g in own_groups]
        if self.own_param_groups and host_params is None:
            raise ValueError("own_groups are host_params groups: pass the HostParamStore serving them as host_params")
        self.own_state: Dict[torch.Tensor, Dict[str, Any]] = {}
        self._own_group_of = {p: g for g in self.own_param_groups for p in g["params"]}
        self.reduce_group = reduce_group  # None: the world, as DeepSpeed's data-parallel group is without an mpu
        self._streamed: Dict[torch.Tensor, Optional[Any]] = {}  # own params with a host gradient not yet stepped
        self.peak_streamed_gradient_bytes = 0  # the largest gradient seen on the device by the streaming hook
        self.clip_grad = clip_grad
        self.communication_dtype: Optional[torch.dtype] = None  # the engine's, set by ``attach_to_engine``
        # set by ``ds_state.include_in_gradient_norm``: this step's (global norm, loss scale), own gradients included
        self.global_grad_norm: Optional[Callable[[], Any]] = None
        self._hooks = ([p.register_post_accumulate_grad_hook(self._stream_gradient) for p in self._own_group_of]
                       if stream_gradients else [])
        self.adamw_mode = adamw_mode
        self.host_params = host_params
        # The CPU Adam object only owns a kernel instance (opt_id, adamw mode); its own param list stays a dummy.
        self._cpu_adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay, adamw_mode=adamw_mode,
                                          bias_correction=bias_correction)
        self._device_adam = None  # built on the first CUDA device group
        self._cuda = torch.cuda.is_available()
        self._pin = pin_memory and self._cuda
        self._d2h = torch.cuda.Stream() if self._cuda else None
        self._h2d = torch.cuda.Stream() if self._cuda else None
        self._masters: Dict[torch.Tensor, torch.Tensor] = {}
        self._grad_buffers: Dict[torch.Tensor, torch.Tensor] = {}
        self._stale_masters: set = set()
        # since construction; ZeRO 1/2 call step() once per group, so callers take differences
        self.moved_bytes = 0
        self.moved_bytes_by_group: Dict[str, int] = {}  # the same, per ``placement``

    # ----- placement -----------------------------------------------------------------------------------------
    def _host_zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=torch.float32, device=HOST, pin_memory=self._pin)

    def _master(self, p: torch.Tensor, level: str) -> torch.Tensor:
        """The host fp32 master of ``p``: the host params themselves at host_params in fp32, else a host copy (of
        the params, or of the bf16 host params)."""
        source = p
        if level == PlacementLevel.HOST_PARAMS.value:
            source = self.host_params.host_tensor(p)
            if source.dtype == torch.float32:
                return source
        master = self._masters.get(p)
        if master is None:
            master = self._masters[p] = self._host_zeros(p)
            master.copy_(source.detach())
        elif p in self._stale_masters:
            master.copy_(source.detach())
            self._stale_masters.discard(p)
        return master

    def fp32_master(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 value this optimizer steps for an own-group param ``p`` (None for any other param)."""
        if p not in self._own_group_of:
            return None
        return self._master(p, PlacementLevel.HOST_PARAMS.value)

    def state_of(self, p: torch.Tensor) -> Dict[str, Any]:
        """The optimizer state of ``p``: own-group states live outside ``self.state``, which torch's
        ``state_dict`` packs by ``param_groups`` alone."""
        return self.own_state.setdefault(p, {}) if p in self._own_group_of else self.state[p]

    def _state(self, p: torch.Tensor) -> Dict[str, Any]:
        """The state of ``p`` stepped by the CPU kernel, created at its first step."""
        state = self.state_of(p)
        if not state:
            state.update(step=0, exp_avg=self._host_zeros(p), exp_avg_sq=self._host_zeros(p))
        return state

    def seed_states(self, step: Any) -> None:
        """Zero moments and the step count ``step`` (an int or a tensor) for every param, placed where this plan
        steps them, as a loaded checkpoint's (:meth:`_place_state`), and the CPU kernel's bias correction brought to
        ``step``: the state a delink writes the carried moments into. Nothing is allocated on the device for a
        group the plan steps on the host."""
        step = int(step.item()) if torch.is_tensor(step) else int(step)
        for group in self.param_groups + self.own_param_groups:
            for p in group["params"]:
                on = p.device if self._steps_on_device(p, group["level"]) else HOST
                state = self.state_of(p)
                state.clear()
                state.update(step=step, **{key: torch.zeros(p.shape, dtype=torch.float32, device=on,
                                                            pin_memory=self._pin and on == HOST)
                                           for key in ("exp_avg", "exp_avg_sq")})
                self._place_state(state, p, group["level"])
        self._replay_kernel_steps(step)

    # ----- step ----------------------------------------------------------------------------------------------
    def _adam_kernel(self, group: Dict[str, Any], param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any]):
        """DeepSpeed's CPU Adam kernel, in place on host fp32 tensors (internal API of DeepSpeed 0.19.8 cpu_adam)."""
        state["step"] += 1
        beta1, beta2 = group["betas"]
        self._cpu_adam.ds_opt_adam.adam_update(self._cpu_adam.opt_id, state["step"], group["lr"], beta1, beta2,
                                               group["eps"], group["weight_decay"], group["bias_correction"],
                                               param, grad, state["exp_avg"], state["exp_avg_sq"])

    def _device_step(self, group: Dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        cuda = [p for p in params if p.device.type == "cuda"]
        for p in params:
            if p.device == HOST:
                self._adam_kernel(group, p.data, p.grad.data, self._state(p))
        if cuda:
            if self._device_adam is None:
                self._device_adam = _fused_device_adam([torch.nn.Parameter(torch.zeros(1, device="cuda"))],
                                                       self.adamw_mode, self.defaults)
                self._device_adam.state = self.state
            self._device_adam.param_groups = [{**self._device_adam.defaults, **group, "params": cuda}]
            self._device_adam.step()

    def _start_grad_copies(self, groups: List[Dict[str, Any]]) -> List[Any]:
        """Issue every host group's gradient D2H copy at once (side stream on CUDA) so they overlap host steps."""
        if self._cuda:
            self._d2h.wait_stream(torch.cuda.current_stream())
        pending = []
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = self._grad_buffers.get(p)
                if grad is None:
                    grad = self._grad_buffers[p] = self._host_zeros(p)
                event = None
                if p.grad.is_cuda:
                    with torch.cuda.stream(self._d2h):
                        grad.copy_(p.grad, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self._d2h)
                else:
                    grad.copy_(p.grad)
                self._count_moved(group, grad)
                pending.append((group, p, grad, event))
        return pending

    def _host_step(self, pending: List[Any]) -> None:
        if self._cuda:
            self._h2d.wait_stream(torch.cuda.current_stream())  # nothing queued may still read the params
        for group, p, grad, event in pending:
            if event is not None:
                event.synchronize()
            master = self._master(p, group["level"])
            self._adam_kernel(group, master, grad, self._state(p))
            if group["level"] == PlacementLevel.HOST_PARAMS.value:
                continue  # the host params are the master: the next fetch carries the update
            if p.is_cuda:
                with torch.cuda.stream(self._h2d):
                    p.data.copy_(master, non_blocking=True)
            else:
                p.data.copy_(master)
            self._count_moved(group, master)
        if self._cuda:
            # ZeRO copies the fp32 partition into the working params right after step() returns
            torch.cuda.current_stream().wait_stream(self._h2d)

    @torch.no_grad()
    def _stream_gradient(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of an own-group param: average its gradient over the data-parallel ranks on
        the device, copy it into the host buffer (added there under gradient accumulation) and free it."""
        grad, group = p.grad, self._own_group_of[p]
        self.peak_streamed_gradient_bytes = max(self.peak_streamed_gradient_bytes, grad.numel() * grad.element_size())
        if dist.is_initialized() and dist.get_world_size(self.reduce_group) > 1:
            grad = grad.to(self.communication_dtype or grad.dtype)  # DeepSpeed's rounding: bf16 runs reduce in bf16
            # DeepSpeed's averaging (0.19.8 ZeRO ``average_tensor``): summed over the ranks holding the same
            # parameters (for experts, their expert-data-parallel group), divided by the data-parallel size
            sum_group = self._sum_group_of(group)
            if dist.get_world_size(sum_group) > 1:
                dist.all_reduce(grad, group=sum_group)
            grad.div_(dist.get_world_size(self.reduce_group))
        buffer = self._grad_buffers.get(p)
        if buffer is None:
            buffer = self._grad_buffers[p] = self._host_zeros(p)
        event = None
        if p in self._streamed:  # a later micro-batch of the same optimizer step
            self._wait_streamed(p)
            buffer.add_(grad.to(HOST, torch.float32))
        elif grad.is_cuda:
            self._d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._d2h):
                buffer.copy_(grad, non_blocking=True)
                grad.record_stream(self._d2h)  # freed below, still read by the copy
                event = torch.cuda.Event()
                event.record(self._d2h)
        else:
            buffer.copy_(grad)
        self._streamed[p] = event
        self._count_moved(group, buffer)
        p.grad = None

    def _sum_group_of(self, group: Dict[str, Any]):
        """The ranks a group's gradients are summed over: its expert-data-parallel group for MoE experts."""
        if group.get("moe"):
            from ds_pseudo_real.ds_state import expert_data_parallel_group

            return expert_data_parallel_group(group["name"])
        return self.reduce_group

    def _collect_gradients(self) -> None:
        """Without streaming: copy the own params' gradients (reduced by the engine) to the host and free them."""
        if self._hooks:
            return
        pending = [g for g in self.own_param_groups if any(p.grad is not None for p in g["params"])]
        for group, p, buffer, event in self._start_grad_copies(pending):
            self._streamed[p] = event
            if p.grad.is_cuda:
                p.grad.record_stream(self._d2h)  # freed below, still read by the copy
            p.grad = None

    def _wait_streamed(self, p: torch.Tensor) -> None:
        event = self._streamed.get(p)
        if event is not None:
            event.synchronize()
            self._streamed[p] = None

    def own_grad_norm(self) -> torch.Tensor:
        """L2 norm of the own groups' gradients (averaged over the ranks), fp32 on the host.

        Experts count as DeepSpeed counts its expert groups: the squares of every rank's experts summed over the
        data-parallel ranks (each expert once: divided by its expert-data-parallel replicas). A collective when
        there are own expert groups: call it on every rank."""
        self._collect_gradients()
        for p in list(self._streamed):
            self._wait_streamed(p)
        squares = {False: torch.zeros((), dtype=torch.float32), True: torch.zeros((), dtype=torch.float32)}
        for p in self._streamed:
            group = self._own_group_of[p]
            square = torch.linalg.vector_norm(self._grad_buffers[p]).pow(2)
            if group.get("moe") and dist.is_initialized():
                square = square / dist.get_world_size(self._sum_group_of(group))
            squares[bool(group.get("moe"))] += square
        if any(g.get("moe") for g in self.own_param_groups) and dist.is_initialized():
            experts = squares[True].to(self._collective_device())
            dist.all_reduce(experts, group=self.reduce_group)
            squares[True] = experts.to(HOST)
        return (squares[False] + squares[True]).sqrt()

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self._cuda else HOST

    def _gradient_factor(self) -> float:
        """The factor DeepSpeed applied to its own gradients this step: 1 / (loss scale x clipping)."""
        if self.global_grad_norm is None:
            if self.clip_grad <= 0.0:
                return 1.0
            raise RuntimeError("granular_offload: host_params groups outside DeepSpeed's optimizer need the global "
                               "gradient norm under gradient_clipping > 0; build the engine with "
                               "ds_pseudo_real.initialize, or call ds_pseudo_real.offload.attach_to_engine(engine) "
                               "after deepspeed.initialize")
        norm, scale = self.global_grad_norm()
        combined = float(scale)
        if self.clip_grad > 0.0:
            clip = ((float(norm) / scale) + 1e-6) / self.clip_grad  # DeepSpeed's rule: its norm is norm x scale
            combined = clip * scale if clip > 1.0 else scale
        return 1.0 / combined

    def _own_step(self) -> None:
        """Step every own-group param that received a gradient since the last step (once per optimizer step: the
        streamed set is emptied here, so ZeRO's later per-group calls find nothing to do)."""
        self._collect_gradients()
        if self._streamed:
            self._step_streamed(self._gradient_factor())

    def zero_gradient_step(self) -> None:
        """One step of the own groups with zero gradients: what DeepSpeed's stage-0 unfused optimizer (bf16 with a
        client optimizer) does to every group it holds when it is built, so that all groups count the same steps
        (and have had the same weight decay)."""
        for p in self._own_group_of:
            buffer = self._grad_buffers.get(p)
            if buffer is None:
                buffer = self._grad_buffers[p] = self._host_zeros(p)
            buffer.zero_()
            self._streamed[p] = None
        self._step_streamed(1.0)

    def _step_streamed(self, factor: float) -> None:
        scheduled = self.param_groups[0]
        for p in list(self._streamed):
            self._wait_streamed(p)
            group = self._own_group_of[p]
            group.update({k: scheduled[k] for k in _SCHEDULED_KEYS if k in scheduled})
            master = self._master(p, PlacementLevel.HOST_PARAMS.value)
            grad = self._grad_buffers[p]
            if factor != 1.0:
                grad.mul_(factor)
            self._adam_kernel(group, master, grad, self._state(p))
            host = self.host_params.host_tensor(p)
            if master is not host:
                host.copy_(master)  # bf16: round the master into the host params (no device copy)
        self._streamed.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the own groups' gradients dropped too (:meth:`drop_own_gradients`)."""
        super().zero_grad(set_to_none)
        self.drop_own_gradients()

    def drop_own_gradients(self) -> None:
        """Forget the own groups' gradients not stepped yet, on the device and in the host buffers; their weights,
        moments and step counts stay. What DeepSpeed does with its own gradients when it zeroes them, which it
        does after every optimizer step, a skipped one (inf or NaN gradients) included."""
        for p in self._own_group_of:
            p.grad = None
        for p in list(self._streamed):
            self._wait_streamed(p)  # a copy still in flight would write the buffer after this
        self._streamed.clear()

    def remove_hooks(self) -> None:
        """Take the gradient-streaming hooks and the host-param fetch hooks off the model (before a delink)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.host_params is not None:
            self.host_params.remove()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._own_step()
        host_groups = [g for g in self.param_groups if g["level"] != PlacementLevel.DEVICE.value]
        pending = self._start_grad_copies(host_groups)
        for group in self.param_groups:  # device kernels run on the device while the host steps below
            if group["level"] == PlacementLevel.DEVICE.value:
                self._device_step(group)
        self._host_step(pending)
        return loss

    # ----- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict of ``param_groups``, plus the own groups' states and (bf16) fp32 masters in order."""
        out = super().state_dict()
        if self.own_param_groups:
            out[OWN_GROUPS_KEY] = [
                {"placement": g["placement"], "numels": [p.numel() for p in g["params"]],
                 "names": g.get("param_names"),
                 "states": [self.own_state.get(p, {}) for p in g["params"]],
                 "masters": [None if p in self._stale_masters else self._masters.get(p) for p in g["params"]]}
                for g in self.own_param_groups]
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load states saved by any plan with the same host_params groups: the current plan's group keys are kept,
        host states go back to the host (torch moves every state onto its param's device) and the host masters are
        re-read from the params (own groups' bf16 masters: restored as saved)."""
        state_dict = dict(state_dict)
        own = state_dict.pop(OWN_GROUPS_KEY, [])
        layout = [(g["placement"], [p.numel() for p in g["params"]]) for g in self.own_param_groups]
        if [(g["placement"], g["numels"]) for g in own] != layout:
            raise ValueError(f"optimizer checkpoint: its granular offload host_params groups "
                             f"{[g['placement'] for g in own]} (outside DeepSpeed's optimizer, ZeRO >= 1 or bf16) "
                             f"differ from this plan's {[name for name, _ in layout]}; load it with the plan it was "
                             f"saved with, or load the module weights only")
        placement = [{k: g[k] for k in _GROUP_KEYS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, keep in zip(self.param_groups, placement):
            for key in _GROUP_KEYS:
                group.pop(key, None)
            group.update(keep)
            for p in group["params"]:
                if self.state.get(p):
                    self._place_state(self.state[p], p, group["level"])
        self.refresh_host_masters()
        for group, saved in zip(self.own_param_groups, own):
            for p, state, master in zip(group["params"], saved["states"], saved["masters"]):
                if state:
                    self.own_state[p] = dict(state)
                    self._place_state(self.own_state[p], p, group["level"])
                if master is not None:
                    self._master(p, group["level"]).copy_(master)
                    self._stale_masters.discard(p)
        self._streamed.clear()
        states = list(self.state.values()) + list(self.own_state.values())
        steps = [st["step"] for st in states if isinstance(st.get("step"), int)]
        self._replay_kernel_steps(max(steps, default=0))

    @staticmethod
    def _steps_on_device(p: torch.Tensor, level: str) -> bool:
        """True when torch's fused CUDA Adam steps ``p``; else DeepSpeed's CPU Adam kernel does, on the host."""
        return level == PlacementLevel.DEVICE.value and p.is_cuda

    def _place_state(self, state: Dict[str, Any], p: torch.Tensor, level: str) -> None:
        """Put loaded or seeded moments where this plan steps them: the CPU kernel takes host tensors (pinned on
        CUDA) and an int step; torch's fused CUDA Adam takes device tensors and a float32 step tensor there."""
        on_cuda = self._steps_on_device(p, level)
        for key in ("exp_avg", "exp_avg_sq"):
            if on_cuda:
                state[key] = state[key].to(p.device)
            elif state[key].device != HOST or (self._pin and not state[key].is_pinned()):
                host = self._host_zeros(state[key])
                host.copy_(state[key])
                state[key] = host
        step = state["step"]
        if on_cuda and not torch.is_tensor(step):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif on_cuda:
            state["step"] = step.to(device=p.device, dtype=torch.float32)
        elif torch.is_tensor(step):
            state["step"] = int(step.item())

    def _replay_kernel_steps(self, last_step: int) -> None:
        """Bring the CPU Adam kernel's bias-correction state to where an uninterrupted run would have it.

        The kernel (DeepSpeed 0.19.8 ``Adam_Optimizer::IncrementStep``) multiplies beta^t by beta once per new
        step, but recomputes it with pow() after a jump (a resume), which differs in the last bit and makes a
        resumed run leave the uninterrupted trajectory. Replaying steps 1..last_step with lr 0 on a one-element
        dummy reproduces the product exactly.
        """
        beta1, beta2 = self.param_groups[0]["betas"]
        group = self.param_groups[0]
        dummy = [torch.zeros(1) for _ in range(4)]
        for step in range(1, last_step + 1):
            self._cpu_adam.ds_opt_adam.adam_update(self._cpu_adam.opt_id, step, 0.0, beta1, beta2, group["eps"],
                                                   0.0, group["bias_correction"], *dummy)

    def refresh_host_masters(self) -> None:
        """Re-read the host masters from the params at the next step. Needed after anything writes the params
        outside this optimizer (a checkpoint loaded without optimizer states, a delink copying weights)."""
        self._stale_masters = set(self._masters)

    # ----- accounting ----------------------------------------------------------------------------------------
    def _count_moved(self, group: Dict[str, Any], tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.moved_bytes += size
        self.moved_bytes_by_group[group["placement"]] = self.moved_bytes_by_group.get(group["placement"], 0) + size

    def held_bytes(self) -> Dict[str, int]:
        """Bytes this optimizer holds now: ``device`` (moments of device groups) and ``host`` (host masters, gradient
        buffers and moments of host groups; at host_params the master is the host params, counted here)."""
        by_group = self.held_bytes_by_group().values()
        return {where: sum(held[where] for held in by_group) for where in ("device", "host")}

    def held_bytes_by_group(self) -> Dict[str, Dict[str, int]]:
        """``held_bytes`` of each group, keyed by its ``placement`` (groups sharing one are summed)."""
        out: Dict[Any, Dict[str, int]] = {}
        for group in self.param_groups + self.own_param_groups:
            held = out.setdefault(group["placement"], {"device": 0, "host": 0})
            where = "device" if group["level"] == PlacementLevel.DEVICE.value else "host"
            for p in group["params"]:
                state = (self.own_state if p in self._own_group_of else self.state).get(p) or {}
                held[where] += sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t)
                                   and k in ("exp_avg", "exp_avg_sq"))
                if where == "host":
                    host = (self.host_params.host_tensor(p) if group["level"] == PlacementLevel.HOST_PARAMS.value
                            else None)
                    for tensor in (host, self._masters.get(p), self._grad_buffers.get(p)):
                        if tensor is not None:
                            held["host"] += tensor.numel() * tensor.element_size()
        return out
