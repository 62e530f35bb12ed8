"""Delinking a Megatron pseudo model into the real one: in process at an iteration, or from a dist checkpoint.

Owns: rebuilding the real model from the pseudo weights, handing it to the caller's DDP/optimizer factory, and
carrying every layer's fp32 master and Adam's moments across per the ``pseudo_to_real.optimizer_state`` policy
(copy / reset / scale, the same rule as the DeepSpeed path: ``ds_pseudo_real.transition.member_moments``).
In-place untie + re-wrap is not an option under Megatron's DDP: its grad hooks and buffers hold the old Parameters.
Megatron internals used (written against megatron-core 0.16.1, all in ``_AdamState``): DistributedOptimizer's
``buffers[i].param_index_map``, ``model_param_group_index_map``, ``_get_model_param_range_map``,
``_get_main_param_and_optimizer_states``, ``_set_main_param_and_optimizer_states``,
``_init_optimizer_states_with_dummy_values``; Float16OptimizerWithFloat16Params' ``float16_groups``,
``fp32_from_float16_groups``, ``fp32_from_fp32_groups``; its and FP32Optimizer's ``optimizer.state``.

Measured (tests/megatron/test_megatron_delink.py): copying the shared moments, which are about L (first) and L**2
(second) times a single layer's, does not inflate the first update: Adam's step m/sqrt(v) is invariant to that
common scale, and per kind of parameter (experts, router, attention, norms) the first update under ``copy`` is
0.96x the one under ``scale``. A loss rise after an M6 MoE delink (4.136 -> 5.152 at lr 1e-2) was the pseudo
model's own: with no switch at all it rose to 5.164 (``scale`` 5.619, ``reset`` 5.442); at lr 3e-3 the pseudo run,
``copy`` and ``scale`` all keep falling (3.868 -> 3.625, 3.647, 3.634).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from ds_pseudo_real.config import OptimizerStatePolicy
from ds_pseudo_real.device import rank_device
from ds_pseudo_real.sharing import expand_state_dict
from ds_pseudo_real.transition import member_moments
from megatron_patches.shared_block import LAYERS, SharedParameterTransformerBlock, grouped_sharded_state_dict

MOMENTS = ("exp_avg", "exp_avg_sq")


def load_pseudo_dist_checkpoint(real_module: torch.nn.Module, directory: str, groups: int = 1) -> torch.nn.Module:
    """Offline delink: load a pseudo model's dist checkpoint (``groups`` sharing groups) into the real model (same
    config, no sharing, no pipeline parallelism; a GPTModel: its ``decoder`` is the block that was shared). Every
    layer gets its group's weights. Optimizer state does not carry over this way: the real run starts it afresh.
    (On any layout, the drop-in resumes a pseudo checkpoint and delinks in process.)
    """
    decoder = real_module.decoder
    # Ask for the layout the pseudo block saved (each group once), then give every layer its group's tensors.
    decoder.sharded_state_dict = functools.partial(grouped_sharded_state_dict, decoder, groups)
    try:
        request = real_module.sharded_state_dict()
    finally:
        del decoder.sharded_state_dict
    loaded = dist_checkpointing.load(request, directory)
    real_module.load_state_dict(expand_state_dict(loaded, f"decoder.{LAYERS}", len(decoder.layers), groups))
    return real_module


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def zero_lr(torch_optimizer: torch.optim.Optimizer):
    """Adam with lr 0 (and so no decoupled weight decay) leaves the weights exactly as they are."""
    saved = [group["lr"] for group in torch_optimizer.param_groups]
    for group in torch_optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in zip(torch_optimizer.param_groups, saved):
            group["lr"] = lr


def _group_step(group: Dict) -> Optional[torch.Tensor]:
    """The step count a param group keeps (Transformer Engine's and apex's FusedAdam count there, not per parameter)."""
    return torch.tensor(float(group["step"])) if "step" in group else None


def _set_group_step(group: Dict, step: torch.Tensor) -> None:
    """Set a group's count in the form the optimizer keeps it: an int, or a tensor (TE's capturable FusedAdam)."""
    count = int(step.item())
    current = group.get("step")
    group["step"] = current.new_full(current.shape, count) if torch.is_tensor(current) else count


class _AdamState:
    """Full (unsharded) Adam moments and fp32 master of one model parameter, read from / written to a Megatron
    optimizer. ``read`` returns ``exp_avg``, ``exp_avg_sq``, ``step`` (those the optimizer has) and ``main``
    (the fp32 master: more precise than the bf16/fp16 weights the real model is loaded from). The step count is
    read from the parameter's state (torch's Adam/AdamW) or, where the optimizer keeps none there, from its param
    group (Transformer Engine's and apex's FusedAdam, Megatron's Adam on a GPU machine); ``step_in_group`` says
    which, and ``write`` puts it back there."""

    def __init__(self, inner):
        if isinstance(inner, DistributedOptimizer):
            self.inner, self.main = inner, None
            return
        if isinstance(inner, FP32Optimizer):
            self.main = {id(p): p for group in inner.optimizer.param_groups for p in group["params"]}
        elif isinstance(inner, Float16OptimizerWithFloat16Params):
            # Its torch optimizer steps fp32 copies of the bf16/fp16 weights (and the fp32 weights themselves);
            # Adam's state is keyed by those.
            self.main = {id(model): main for models, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups)
                         for model, main in zip(models, mains)}
            self.main.update({id(p): p for group in inner.fp32_from_fp32_groups for p in group})
        else:
            raise NotImplementedError(
                f"in-process delink: optimizer {type(inner).__name__} is not supported; accepted: "
                f"DistributedOptimizer, Float16OptimizerWithFloat16Params (bf16/fp16) and FP32Optimizer"
            )
        self.inner = inner
        self.groups = {id(p): group for group in inner.optimizer.param_groups for p in group["params"]}

    def _group_of(self, param: torch.nn.Parameter) -> Dict:
        """The torch optimizer's param group that steps ``param`` (its fp32 master, or this rank's shard of it)."""
        if self.main is not None:
            return self.groups[id(self.main[id(param)])]
        return self.inner.optimizer.param_groups[self.inner.model_param_group_index_map[param][0]]

    def holds(self, param: torch.nn.Parameter) -> bool:
        if self.main is None:  # on every rank, whether or not it owns a shard of it
            return any(param in buffer.param_index_map for buffer in self.inner.buffers)
        return id(param) in self.main

    def read(self, param: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """Collective over the optimizer's data-parallel group for a DistributedOptimizer."""
        if self.main is not None:
            main = self.main[id(param)]
            state = self.inner.optimizer.state.get(main, {})
            out = {"main": main.detach().clone(), **{k: state[k].detach().clone() for k in MOMENTS if k in state}}
            if "step" in state:
                out["step"] = state["step"].detach().clone()
            elif "exp_avg" in state and "step" in self._group_of(param):
                out.update(step=_group_step(self._group_of(param)), step_in_group=True)
            return out
        # shards summed in, on the rank's device: the data-parallel group is NCCL's on a GPU machine
        device = rank_device()
        full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=device) for k in ("main", *MOMENTS)}
        step = torch.zeros((), dtype=torch.float32, device=device)
        in_group = torch.zeros((), dtype=torch.float32, device=device)
        if param in self.inner.model_param_group_index_map:
            shard = self.inner._get_main_param_and_optimizer_states(param)
            where = self.inner._get_model_param_range_map(param)["param"]
            for k, source in (("main", "param"), *((m, m) for m in MOMENTS)):
                if source in shard:
                    full[k][where.start:where.end] = shard[source].detach().float().view(-1)
            if "step" in shard:  # torch's Adam keeps it on the host
                step = shard["step"].detach().float().to(device, copy=True)
            elif "step" in self._group_of(param):
                step, in_group = _group_step(self._group_of(param)).to(device), torch.ones((), device=device)
        for tensor in full.values():
            dist.all_reduce(tensor, group=self.inner.data_parallel_group)
        for tensor in (step, in_group):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.inner.data_parallel_group)
        return {**{k: v.view(param.shape) for k, v in full.items()}, "step": step, "step_in_group": bool(in_group)}

    def prepare_write(self) -> None:
        """A DistributedOptimizer only has state tensors to write into after a step: take one that changes nothing.
        Only for moments: its fp32 masters exist from the start."""
        if self.main is None:
            with zero_lr(self.inner.optimizer):
                self.inner._init_optimizer_states_with_dummy_values()

    @torch.no_grad()
    def write(self, param: torch.nn.Parameter, main: torch.Tensor, moments: Optional[Dict[str, torch.Tensor]],
              step: Optional[torch.Tensor], step_in_group: bool = False) -> None:
        """Set the fp32 master to ``main`` and, unless ``moments`` is None (reset), Adam's moments and step (in the
        parameter's state, or in its param group when ``step_in_group``)."""
        if self.main is not None:
            target = self.main[id(param)]
            if target is not param:
                target.copy_(main)
            if moments is not None:
                state = {k: moments[k].clone() for k in MOMENTS}
                if step_in_group:
                    _set_group_step(self._group_of(param), step)
                else:
                    state["step"] = step.clone()
                self.inner.optimizer.state[target] = state
            return
        if param not in self.inner.model_param_group_index_map:
            return
        where = self.inner._get_model_param_range_map(param)["param"]
        tensors = {"param": main.reshape(-1)[where.start:where.end]}
        if moments is not None:
            if step_in_group:
                _set_group_step(self._group_of(param), step)
            else:
                current = self.inner._get_main_param_and_optimizer_states(param)
                tensors["step"] = step.to(current["step"].dtype)
            for k in MOMENTS:
                tensors[k] = moments[k].reshape(-1)[where.start:where.end]
        self.inner._set_main_param_and_optimizer_states(param, tensors)


def read_adam_states(module: torch.nn.Module, optimizer) -> Dict[int, Dict[str, torch.Tensor]]:
    """Master, Adam moments and step of every unique parameter of ``module``, keyed by ``id(param)``.

    Collective for a DistributedOptimizer (every rank gets the full tensors): call it on every rank."""
    out = {}
    for inner in _inner_optimizers(optimizer):
        access = _AdamState(inner)
        for _, param in module.named_parameters():
            if access.holds(param):
                out[id(param)] = access.read(param)
    return out


def _write_states(sources: Sequence[Tuple[torch.nn.Module, Callable[[str], tuple]]], optimizer, moments: bool) -> None:
    """Write every (chunk, its parameter name -> state) of ``sources`` into ``optimizer``."""
    for inner in _inner_optimizers(optimizer):
        access = _AdamState(inner)
        if moments:
            access.prepare_write()  # once: it steps every chunk's parameters
        for module, source in sources:
            for name, param in module.named_parameters():
                if access.holds(param):
                    access.write(param, *source(name))


def layers_sharing(pseudo: torch.nn.Module) -> Dict[int, int]:
    """How many layers of the whole model use each parameter of a pseudo chunk, by ``id``: its group's size for a
    shared block's parameters (a pipeline stage may hold only some of the group's layers), else how many times the
    chunk uses it."""
    uses: Dict[int, int] = {}
    for _, param in pseudo.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for block in pseudo.modules():
        if isinstance(block, SharedParameterTransformerBlock):
            for param in block.layers.parameters():
                uses[id(param)] = block.config.num_layers // block.sharing_groups
    return uses


def delink_in_process(
    model_chunks: Sequence[torch.nn.Module],
    optimizer,
    build_wrapped: Callable[[], Tuple[List[torch.nn.Module], object]],
    policy: str = OptimizerStatePolicy.COPY.value,
):
    """Replace the pseudo model (Megatron-DDP-wrapped chunks) and its optimizer by the real ones; same outputs.

    ``build_wrapped()`` builds the real model (same config, plain TransformerBlock) wrapped the way the run wraps
    it, with a fresh optimizer, and returns ``(chunks, optimizer)`` (Megatron-LM: ``setup_model_and_optimizer``).
    The pseudo weights are loaded into it (state-dict keys are the same: the shared block keeps every layer's
    name) and every layer's fp32 master is set to the shared one (bf16/fp16 weights alone would round it). Adam's
    moments follow ``policy``: ``copy`` (every layer starts from the shared moments), ``scale`` (divided by the
    number of layers that shared them, squared for the second moment) or ``reset``; the step count is kept except
    on ``reset``; an fp16 loss scale carries over. Call it on every rank at the same iteration, between optimizer
    steps.
    """
    policy = OptimizerStatePolicy(policy).value
    carry = policy != OptimizerStatePolicy.RESET.value
    pseudo_modules = [chunk.module for chunk in model_chunks]
    states = [read_adam_states(m, optimizer) for m in pseudo_modules]
    new_chunks, new_optimizer = build_wrapped()
    sources = []
    for pseudo, chunk, chunk_states in zip(pseudo_modules, new_chunks, states):
        chunk.module.load_state_dict(pseudo.state_dict(), strict=True)
        named = dict(pseudo.named_parameters(remove_duplicate=False))

        def source(name, named=named, uses=layers_sharing(pseudo), chunk_states=chunk_states):
            shared = named[name]
            state = chunk_states[id(shared)]
            if not carry or "exp_avg" not in state:  # reset, or a parameter Adam has not stepped yet
                return state["main"], None, None
            moments = member_moments(policy, {k: state[k] for k in MOMENTS}, uses[id(shared)])
            return state["main"], moments, state["step"], state.get("step_in_group", False)

        sources.append((chunk.module, source))
    _write_states(sources, new_optimizer, moments=carry)
    for old, new in zip(_inner_optimizers(optimizer), _inner_optimizers(new_optimizer)):
        if getattr(old, "grad_scaler", None) is not None and getattr(new, "grad_scaler", None) is not None:
            # fp16's dynamic loss scale: a fresh one would skip steps on overflow until it found its level again.
            new.grad_scaler.load_state_dict(old.grad_scaler.state_dict())
    return new_chunks, new_optimizer
