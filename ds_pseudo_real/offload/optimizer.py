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
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from ds_pseudo_real.offload.planner import PlacementLevel

HOST = torch.device("cpu")
# kept from the current plan when a checkpoint is loaded: ours, and DeepSpeed's MoE keys (checkpoints written
# before expert groups existed hold the plan's group name under "name")
_GROUP_KEYS = ("placement", "level", "moe", "name")


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
    any group is at ``host_params``.
    """

    def __init__(self, param_groups: Iterable[Dict[str, Any]], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
                 pin_memory: bool = True, host_params=None):
        groups = [dict(g) for g in param_groups]
        for g in groups:
            g["level"] = PlacementLevel(g.get("level", PlacementLevel.DEVICE)).value
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, placement=None, level=PlacementLevel.DEVICE.value)
        super().__init__(groups, defaults)
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
        """The host fp32 master of ``p``: the host params themselves at host_params, else a host copy."""
        if level == PlacementLevel.HOST_PARAMS.value:
            return self.host_params.host_tensor(p)
        master = self._masters.get(p)
        if master is None:
            master = self._masters[p] = self._host_zeros(p)
            master.copy_(p.detach())
        elif p in self._stale_masters:
            master.copy_(p.detach())
            self._stale_masters.discard(p)
        return master

    def _state(self, p: torch.Tensor, on: torch.device) -> Dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=on, pin_memory=self._pin and on == HOST)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        return state

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
                self._adam_kernel(group, p.data, p.grad.data, self._state(p, HOST))
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
            self._adam_kernel(group, master, grad, self._state(p, HOST))
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
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        host_groups = [g for g in self.param_groups if g["level"] != PlacementLevel.DEVICE.value]
        pending = self._start_grad_copies(host_groups)
        for group in self.param_groups:  # device kernels run on the device while the host steps below
            if group["level"] == PlacementLevel.DEVICE.value:
                self._device_step(group)
        self._host_step(pending)
        return loss

    # ----- checkpoints ---------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load states saved by any plan: the current plan's group keys are kept, host states go back to the
        host (torch moves every state onto its param's device) and the host masters are re-read from the params."""
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
        steps = [st["step"] for st in self.state.values() if isinstance(st.get("step"), int)]
        self._replay_kernel_steps(max(steps, default=0))

    def _place_state(self, state: Dict[str, Any], p: torch.Tensor, level: str) -> None:
        """Put loaded moments where this plan steps them: the CPU kernel takes host tensors and an int step; torch's
        fused CUDA Adam takes device tensors and a float32 step tensor on the device."""
        on_cuda = level == PlacementLevel.DEVICE.value and p.is_cuda
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
        for group in self.param_groups:
            held = out.setdefault(group["placement"], {"device": 0, "host": 0})
            where = "device" if group["level"] == PlacementLevel.DEVICE.value else "host"
            for p in group["params"]:
                state = self.state.get(p) or {}
                held[where] += sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t)
                                   and k in ("exp_avg", "exp_avg_sq"))
                if where == "host":
                    master = (self.host_params.host_tensor(p) if group["level"] == PlacementLevel.HOST_PARAMS.value
                              else self._masters.get(p))
                    for tensor in (master, self._grad_buffers.get(p)):
                        if tensor is not None:
                            held["host"] += tensor.numel() * tensor.element_size()
        return out
