"""Delinking a Megatron pseudo model into the real one: in process at an iteration, or from a dist checkpoint.

Owns: rebuilding the real model from the pseudo weights, handing it to the caller's DDP/optimizer factory, and
carrying Adam's moments across per the ``pseudo_to_real.optimizer_state`` policy (copy / reset / scale, the same
rule as the DeepSpeed path: ``ds_pseudo_real.transition.member_moments``). In-place untie + re-wrap is not an
option under Megatron's DDP: its grad hooks and buffers hold the old Parameters.
Megatron internals used (written against megatron-core 0.16.1, all in ``_AdamState``): DistributedOptimizer's
``buffers[i].param_index_map``, ``model_param_group_index_map``, ``_get_model_param_range_map``,
``_get_main_param_and_optimizer_states``, ``_set_main_param_and_optimizer_states``,
``_init_optimizer_states_with_dummy_values``; FP32Optimizer's ``optimizer.state``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

from ds_pseudo_real.config import OptimizerStatePolicy
from ds_pseudo_real.transition import member_moments

MOMENTS = ("exp_avg", "exp_avg_sq")


def load_pseudo_dist_checkpoint(real_module: torch.nn.Module, directory: str) -> torch.nn.Module:
    """Offline delink: load a pseudo model's dist checkpoint into the real model (same config, no sharing).

    The shared block keeps every layer's number, so its checkpoint names each layer's weights as the real model
    does. Optimizer state does not carry over this way (its layout differs): the real run starts it afresh.
    """
    real_module.load_state_dict(dist_checkpointing.load(real_module.sharded_state_dict(), directory))
    return real_module


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def _zero_lr(torch_optimizer: torch.optim.Optimizer):
    """Adam with lr 0 (and so no decoupled weight decay) leaves the weights exactly as they are."""
    saved = [group["lr"] for group in torch_optimizer.param_groups]
    for group in torch_optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in zip(torch_optimizer.param_groups, saved):
            group["lr"] = lr


class _AdamState:
    """Full (unsharded) Adam moments of one model parameter, read from / written to a Megatron optimizer."""

    def __init__(self, inner):
        if not isinstance(inner, (DistributedOptimizer, FP32Optimizer)):
            raise NotImplementedError(
                f"pseudo_to_real.optimizer_state copy/scale: {type(inner).__name__} is not supported; use "
                f"--use-distributed-optimizer (any precision) or fp32 without it, or optimizer_state 'reset'"
            )
        self.inner = inner

    def holds(self, param: torch.nn.Parameter) -> bool:
        if isinstance(self.inner, DistributedOptimizer):  # on every rank, whether or not it owns a shard of it
            return any(param in buffer.param_index_map for buffer in self.inner.buffers)
        return any(param is p for group in self.inner.optimizer.param_groups for p in group["params"])

    def read(self, param: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """Collective over the optimizer's data-parallel group for a DistributedOptimizer."""
        if isinstance(self.inner, FP32Optimizer):
            state = self.inner.optimizer.state.get(param, {})
            return {k: state[k].detach().clone() for k in (*MOMENTS, "step") if k in state}
        full = {k: torch.zeros(param.numel(), dtype=torch.float32) for k in MOMENTS}  # shards summed into it
        step = torch.zeros((), dtype=torch.float32)
        if param in self.inner.model_param_group_index_map:
            shard = self.inner._get_main_param_and_optimizer_states(param)
            where = self.inner._get_model_param_range_map(param)["param"]
            for k in MOMENTS:
                full[k][where.start:where.end] = shard[k].float()
            step = shard["step"].detach().float().clone()
        for k in MOMENTS:
            dist.all_reduce(full[k], group=self.inner.data_parallel_group)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.inner.data_parallel_group)
        return {**{k: v.view(param.shape) for k, v in full.items()}, "step": step}

    def prepare_write(self) -> None:
        """A DistributedOptimizer only has state tensors to write into after a step: take one that changes nothing."""
        if isinstance(self.inner, DistributedOptimizer):
            with _zero_lr(self.inner.optimizer):
                self.inner._init_optimizer_states_with_dummy_values()

    @torch.no_grad()
    def write(self, param: torch.nn.Parameter, moments: Dict[str, torch.Tensor], step: torch.Tensor) -> None:
        if isinstance(self.inner, FP32Optimizer):
            self.inner.optimizer.state[param] = {"step": step.clone(), **{k: moments[k].clone() for k in MOMENTS}}
            return
        if param not in self.inner.model_param_group_index_map:
            return
        current = self.inner._get_main_param_and_optimizer_states(param)
        where = self.inner._get_model_param_range_map(param)["param"]
        tensors = {"param": current["param"], "step": step.to(current["step"].dtype)}
        for k in MOMENTS:
            tensors[k] = moments[k].reshape(-1)[where.start:where.end]
        self.inner._set_main_param_and_optimizer_states(param, tensors)


def _read_moments(module: torch.nn.Module, optimizer) -> Dict[int, Dict[str, torch.Tensor]]:
    """Moments of every unique parameter of ``module``, keyed by ``id(param)``."""
    out = {}
    for inner in _inner_optimizers(optimizer):
        access = _AdamState(inner)
        for _, param in module.named_parameters():
            if access.holds(param):
                state = access.read(param)
                if state:
                    out[id(param)] = state
    return out


def _write_moments(module: torch.nn.Module, optimizer, source: Callable[[str], Tuple[Dict, torch.Tensor]]) -> None:
    for inner in _inner_optimizers(optimizer):
        access = _AdamState(inner)
        access.prepare_write()
        for name, param in module.named_parameters():
            if access.holds(param):
                found = source(name)
                if found is not None:
                    access.write(param, *found)


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
    name), then Adam's moments follow ``policy``: ``copy`` (every layer starts from the shared moments), ``scale``
    (divided by the number of layers that shared them, squared for the second moment) or ``reset``; the step
    count is kept except on ``reset``. Call it on every rank at the same iteration, between optimizer steps.
    """
    policy = OptimizerStatePolicy(policy).value
    pseudo_modules = [chunk.module for chunk in model_chunks]
    carry = policy != OptimizerStatePolicy.RESET.value
    moments = [_read_moments(m, optimizer) for m in pseudo_modules] if carry else []
    new_chunks, new_optimizer = build_wrapped()
    for pseudo, chunk in zip(pseudo_modules, new_chunks):
        chunk.module.load_state_dict(pseudo.state_dict(), strict=True)
    new_optimizer.reload_model_params()  # main (fp32) copies of bf16/fp16 weights follow the loaded weights
    for pseudo, chunk, chunk_moments in zip(pseudo_modules, new_chunks, moments):
        named = dict(pseudo.named_parameters(remove_duplicate=False))
        uses: Dict[int, int] = {}
        for param in named.values():
            uses[id(param)] = uses.get(id(param), 0) + 1

        def source(name, named=named, uses=uses, chunk_moments=chunk_moments):
            shared = named[name]
            state = chunk_moments.get(id(shared))
            if state is None:
                return None
            return member_moments(policy, {k: state[k] for k in MOMENTS}, uses[id(shared)]), state["step"]

        _write_moments(chunk.module, new_optimizer, source)
    return new_chunks, new_optimizer
