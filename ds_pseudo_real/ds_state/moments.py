"""Adam's moments and step counters, read, seeded and written at every ZeRO stage, and the CPU Adam kernel replay.
Leaves the fp32 masters (weights.py) and checkpoint files (nvme_checkpoint.py) alone (DeepSpeed 0.19.8)."""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

from ..sharing import fill_copies
from .guard import check_places
from .layout import basic_optimizer, is_managed, master_of, optimizer_state, own_copy, stepped_tensors
from .zero3 import resident_sub_group, set_zero3_partition, swapped_sub_group_of, swapped_sub_groups


MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def full_moments(engine, param: torch.nn.Parameter, name: str = "", device: Optional[torch.device] = None
                 ) -> Optional[Dict[str, torch.Tensor]]:
    """``exp_avg``/``exp_avg_sq`` of ``param`` (full, fp32, on ``device``: the CPU when None), or None when it has
    none yet: it is frozen, or its optimizer has not stepped it. Moments its optimizer should hold but that cannot be
    read (DeepSpeed failing after the first step, a state without Adam moments) are a RuntimeError naming the
    parameter, never a silent ``reset``."""
    what = name or "a parameter"
    if not param.requires_grad:
        return None
    if is_managed(param):
        try:
            values = {k: safe_get_full_optimizer_state(param, k) for k in MOMENT_KEYS}
        except (KeyError, TypeError, ValueError) as error:
            if not basic_optimizer(engine).state:
                return None  # no state yet: DeepSpeed creates and links it at this optimizer's first step
            raise RuntimeError(f"cannot read the Adam moments of {what} from DeepSpeed, whose optimizer has stepped "
                               f"({type(error).__name__}: {error}); the delink would silently reset them") from error
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise RuntimeError(f"cannot read the Adam moments of {what}: DeepSpeed gives no {missing} for this "
                               f"trainable parameter; the delink would silently reset them")
        return {k: own_copy(v, device) for k, v in values.items()}
    state = optimizer_state(engine, master_of(engine, param))
    if not state:
        return None
    if not all(k in state for k in MOMENT_KEYS):
        raise RuntimeError(f"cannot read the Adam moments of {what}: its optimizer state holds {sorted(state)}, not "
                           f"{list(MOMENT_KEYS)}; pseudo_to_real.optimizer_state 'copy' and 'scale' carry Adam "
                           f"moments, accepted with this optimizer: 'reset'")
    return {k: own_copy(state[k], device) for k in MOMENT_KEYS}


def step_counters(engine) -> Dict[str, Any]:
    """The optimizer's step counters, in whatever form its class keeps them (per state entry and/or per group).

    ``state_step`` is the highest count among the state entries: torch's Adam/AdamW and DeepSpeed's CPU Adam count in
    every entry alike, but DeepSpeed's FusedAdam counts only in the entry of the last parameter of each group it steps
    (the others keep the count they were created with) and steps the whole group with that count."""
    optimizer = basic_optimizer(engine)
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    state_step = max(steps, key=float) if steps else None
    return {
        "state_step": copy.deepcopy(state_step),
        "group_steps": [copy.deepcopy(g.get("step")) for g in optimizer.param_groups],
    }


def unfilled(shape, device, pin_memory: bool = False) -> torch.Tensor:
    """New contiguous fp32 memory, left as the allocator gives it: for moments the delink writes next (pinned host
    memory: granular offload's, at its exact size)."""
    if pin_memory:
        from ds_pseudo_real.pinned import host_empty

        return host_empty(shape, torch.float32, pin=True)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _storage_address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class UnwrittenMoments:
    """The moments :func:`seed_optimizer_state` left unfilled, and the spans of their memory written since: whatever
    is still unwritten when the carry ends is zeroed by :meth:`zero_rest` (a flat partition's padding, a parameter
    whose source had no moments). Spans are kept per storage, so moments that are views of one flat buffer (granular
    offload's host buffers) and writes through other views of it (DeepSpeed's fragments) meet."""

    def __init__(self) -> None:
        self._moments: Dict[int, List[torch.Tensor]] = {}  # by storage address: the moments left unfilled in it
        self._written: Dict[int, List[Tuple[int, int]]] = {}  # by storage address: (start, end) elements written

    def add(self, moment: torch.Tensor) -> None:
        if not moment.is_contiguous():
            moment.zero_()
        elif moment.numel():
            self._moments.setdefault(_storage_address(moment), []).append(moment)

    def wrote(self, part: torch.Tensor) -> None:
        """``part``, a contiguous tensor in the memory of a moment (the moment, or a view of it), now holds values."""
        address = _storage_address(part) if part.numel() else None
        if address in self._moments:
            start = part.storage_offset()
            self._written.setdefault(address, []).append((start, start + part.numel()))

    def zero_rest(self) -> None:
        for address, moments in self._moments.items():
            spans = sorted(self._written.get(address, []))
            for moment in moments:
                flat, base = moment.view(-1), moment.storage_offset()
                at, end = base, base + moment.numel()
                for start, stop in spans:
                    if start >= end:
                        break
                    if start > at:
                        flat[at - base:start - base].zero_()
                    at = max(at, stop)
                if at < end:
                    flat[at - base:].zero_()
        self._moments.clear()
        self._written.clear()


def seed_optimizer_state(engine, counters: Dict[str, Any]) -> UnwrittenMoments:
    """Create moments and the given step counters for every tensor the optimizer steps; returns the moments left
    unfilled, for :func:`set_full_moments_of_copies` to write and :meth:`UnwrittenMoments.zero_rest` to zero where
    it did not.

    Optimizers create their state lazily at the first step, and DeepSpeed links its per-parameter views of the
    flat fp32 partitions to that state only then; seeding first makes the moments settable before any step.
    The carry writes every moment it has a source for, so the moments are allocated unfilled: one pass over their
    bytes instead of two. That covers a tensor stepped with a state of its own (ZeRO 0: the parameter, or the unfused
    optimizer's fp32 copy of it), written whole, and DeepSpeed's flat partitions of ZeRO 1/2 and the bf16 optimizer,
    written a parameter's fragment at a time, ZeRO-3's sub-groups, written a parameter's partition at a time, and
    granular offload's states (``seed_states``: each group's state where its level steps it). Sub-groups that ZeRO-3
    swaps to NVMe are :func:`write_swapped_moments`'s: their state can be made only while they are in memory.
    """
    optimizer = basic_optimizer(engine)
    unwritten = UnwrittenMoments()
    seed_states = getattr(optimizer, "seed_states", None)
    if seed_states is not None:
        steps = [counters["state_step"], *counters["group_steps"]]
        seed_states(next((s for s in steps if s is not None), 0), unwritten)
        relink_optimizer_state(engine)
        return unwritten
    group_steps = counters["group_steps"]
    for index, group in enumerate(optimizer.param_groups):
        step = group_steps[index] if index < len(group_steps) else group_steps[-1] if group_steps else None
        if step is not None:
            group["step"] = copy.deepcopy(step)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    swapped = {id(flats[i]) for i in swapped_sub_groups(engine)}  # seeded by write_swapped_moments, in memory
    for _, tensor in stepped_tensors(engine):
        if id(tensor) not in swapped:
            _seed_state(engine, tensor, counters, unwritten)
    relink_optimizer_state(engine)
    return unwritten


def _seed_state(engine, tensor: torch.Tensor, counters: Dict[str, Any], unwritten: UnwrittenMoments) -> None:
    state = optimizer_state(engine, tensor)
    for key in MOMENT_KEYS:
        state[key] = unfilled(tensor.shape, tensor.device)
        unwritten.add(state[key])
    if counters["state_step"] is not None:
        state["step"] = copy.deepcopy(counters["state_step"])


def write_swapped_moments(engine, counters: Dict[str, Any],
                          copies: Iterable[Tuple[Iterable[torch.nn.Parameter], Dict[str, torch.Tensor]]]) -> None:
    """The carry into the sub-groups ZeRO-3 swaps to NVMe, which :func:`seed_optimizer_state` leaves alone: for each
    (parameters, the moments to write into each of them) of ``copies`` that lie in such a sub-group (the others are
    :func:`set_full_moments_of_copies`'s), one sub-group at a time, read in, given unfilled moments and the step
    counter, written, zeroed where nothing was written (padding, parameters without a source), written back to its
    files. Every swapped sub-group is seeded, those without a carried parameter too, so that all continue at the
    same step."""
    swapped = swapped_sub_groups(engine)
    if not swapped:
        return
    pending: Dict[int, List[Tuple[torch.nn.Parameter, Dict[str, torch.Tensor]]]] = {}
    for params, moments in copies:
        for param in params:
            index = swapped_sub_group_of(engine, param, swapped)
            if index is not None:
                pending.setdefault(index, []).append((param, moments))
    flats = engine.optimizer.fp32_partitioned_groups_flat
    for index in swapped:
        with resident_sub_group(engine, index, write=True):
            unwritten = UnwrittenMoments()
            _seed_state(engine, flats[index], counters, unwritten)
            for param, moments in pending.pop(index, []):
                set_full_moments_of_copies(engine, [param], moments, unwritten)
            unwritten.zero_rest()


def relink_optimizer_state(engine) -> None:
    """Point every parameter's optimizer-state fragment at the current flat state tensors.

    ZeRO-1/2 and the bf16 optimizer link the fragments once, right after the FIRST parameter group's first step,
    when the other groups have no state yet: their fragments stay empty (DeepSpeed 0.19.8), so
    ``safe_get_full_optimizer_state`` fails for them until relinked.
    """
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None and basic_optimizer(engine).state:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def set_full_moments_of_copies(engine, params: Iterable[torch.nn.Parameter], moments: Dict[str, torch.Tensor],
                               unwritten: Optional[UnwrittenMoments] = None) -> None:
    """Write the same full fp32 ``moments`` into every parameter of ``params`` (the copies of one shared parameter,
    after :func:`seed_optimizer_state`, whose ``unwritten`` record these writes go into): the states of their own
    together, each piece of the moments read once (:func:`~ds_pseudo_real.sharing.fill_copies`, which refuses a
    moment of another shape); DeepSpeed's flat partitions one parameter after another, each reading only the
    fragment this rank holds."""
    states = {key: [] for key in MOMENT_KEYS}
    for param in params:
        if hasattr(param, "ds_id"):
            for key in MOMENT_KEYS:
                written = set_zero3_partition(engine, param, moments[key], key)
                if unwritten is not None:
                    unwritten.wrote(written)
            continue
        if is_managed(param):
            for key in MOMENT_KEYS:
                safe_set_full_optimizer_state(param, moments[key].to(param.device), key)
                if param._hp_mapping is not None and unwritten is not None:  # None: this rank holds none of it
                    unwritten.wrote(param._hp_mapping.get_optim_state_fragment(key))
            continue
        state = optimizer_state(engine, master_of(engine, param))
        for key in MOMENT_KEYS:
            states[key].append(state[key])
    for key, targets in states.items():
        if targets:
            fill_copies(targets, moments[key])
            if unwritten is not None:
                for target in targets:
                    unwritten.wrote(target)


def replay_cpu_adam_steps(engine) -> None:
    """Bring the bias correction of the engine's CPU Adam kernel to where a run that stepped it from step 1 has it,
    for a new engine that starts at a later step: after a delink carries the step counters, or a load restores
    them. DeepSpeed's CPU kernel (``Adam_Optimizer::IncrementStep``) multiplies beta^t by beta at each new step but
    recomputes it with pow() after a jump, which differs in the last bit (beta2 = 0.999: at steps 3 and 6 from step
    1; at steps 4, 5, 7 and 8 from a first step at 3), so an engine started at a later step would leave the
    trajectory of the run it continues. Two optimizers step with it: DeepSpeed CPU Adam (ZeRO's
    ``offload_optimizer``), an instance per optimizer, and FusedAdam on the CPU accelerator, whose op keeps one
    instance per Adam mode for the whole process (``csrc/cpu/adam/fused_adam.cpp``), which ZeRO 1/2's first
    zero-gradient step of a new engine (``initialize_optimizer_states``) moves to step 1. FusedAdam on CUDA
    recomputes the correction at every step: nothing to replay. Granular offload's kernel is replayed by its own
    optimizer (``HostAdam.replay_kernel_steps``)."""
    optimizer = basic_optimizer(engine)
    step = step_counters(engine)["state_step"]
    last_step = int(step.item()) if torch.is_tensor(step) else int(step or 0)
    if getattr(optimizer, "ds_opt_adam", None) is not None and getattr(optimizer, "opt_id", None) is not None:
        replay_kernel_steps(optimizer, last_step, optimizer.param_groups[0])
    elif _fused_adam_on_cpu(optimizer):
        check_places("pseudo_to_real", {"FusedAdam": optimizer})
        replay_fused_adam_kernel(optimizer, last_step, optimizer.param_groups[0])


def _fused_adam_on_cpu(optimizer) -> bool:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam

    return isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu"


def replay_fused_adam_kernel(optimizer, last_step: int, group: Dict[str, Any]) -> None:
    """Steps 1..``last_step`` of the kernel of ``optimizer`` (DeepSpeed's FusedAdam on the CPU: its op's
    ``multi_tensor_adam``) with lr and weight decay 0 on a one-element dummy: only the bias correction of the op's
    kernel for ``optimizer``'s Adam mode moves."""
    beta1, beta2 = group["betas"]
    dummy = [[torch.zeros(1)] for _ in range(4)]  # gradients, params, first and second moments
    for step in range(1, last_step + 1):
        optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, dummy, 0.0, beta1, beta2, group["eps"],
                                    step, optimizer.adam_w_mode, int(group["bias_correction"]), 0.0)


def replay_kernel_steps(cpu_adam, last_step: int, group: Dict[str, Any]) -> None:
    """Steps 1..``last_step`` of ``cpu_adam``'s kernel with lr and weight decay 0 on a one-element dummy: only its
    bias correction (beta^t, a product over the steps it has seen) moves, to where a run from step 1 has it."""
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(1) for _ in range(4)]
    for step in range(1, last_step + 1):
        cpu_adam.ds_opt_adam.adam_update(cpu_adam.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                         group["bias_correction"], *dummy)
