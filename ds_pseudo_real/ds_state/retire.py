"""Retiring a module its engine no longer trains: every link DeepSpeed left from it to that engine cut, using it
an error. Touches the module and its parameters only, never the engine (DeepSpeed 0.19.8)."""
from __future__ import annotations

import torch


_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                      "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks")


def retire_module(module: torch.nn.Module, message: str) -> None:
    """Cut every link from a module its engine no longer trains back to that engine, and make using it an error.

    DeepSpeed 0.19.8 leaves closures over the engine in the module's forward hooks, ZeRO-3 its partitioning
    attributes and hooks on every submodule and parameter, ZeRO 1/2 and bf16 ``_hp_mapping`` links into their flat
    buffers: a caller that keeps the module would keep the whole engine and its optimizer alive. Every hook goes,
    every attribute DeepSpeed added to a parameter goes, parameter storage is released, and a forward raises
    ``RuntimeError(message)``.
    """
    for sub in module.modules():
        for name in _MODULE_HOOK_DICTS:
            hooks = getattr(sub, name, None)
            if hooks is not None:
                hooks.clear()
        for name in [k for k in vars(sub) if k.startswith(("ds_", "_ds", "__ds"))]:
            delattr(sub, name)
        for param in sub._parameters.values():
            if param is None:
                continue
            param.__dict__.clear()  # ds_tensor, ds_id, all_gather/partition closures, _hp_mapping, hook dicts
            param.grad = None
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def dead(*_args, **_kwargs):
        raise RuntimeError(message)

    module.register_forward_pre_hook(dead)
