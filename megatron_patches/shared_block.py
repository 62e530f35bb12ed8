"""The shared-parameter ("pseudo") TransformerBlock for megatron.core: a small subclass, not a fork.

Owns: building a block whose L layers use one parameter set per sharing group, with layers other than each
group's first built on the meta device (they never allocate weights) and then pointed at the leader's
Parameters; its checkpoint layout (each group's parameters saved once, ``grouped_sharded_state_dict``); making
GPTModel build this block (``shared_parameter_decoder``); and undoing the sharing in place. The grouping and tying
themselves are ``ds_pseudo_real.sharing``'s. Written against megatron-core 0.16.1 (TransformerBlock.sharded_state_dict
stacks layer ``layer_number - 1`` of ``config.num_layers`` along a leading axis, keyed ``layers.<module index>.``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Iterator, Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from torch.overrides import TorchFunctionMode

from ds_pseudo_real import sharing

LAYERS = "layers"


class _EmptyOnMeta(TorchFunctionMode):
    """Sends ``torch.empty`` to the meta device, whatever device it names: Megatron and torch allocate every weight
    with it and then initialise it in place. Other factories keep their device: the MoE token dispatcher, for
    one, keeps index tensors made with ``torch.arange`` that the layer needs at run time."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class _BuildOnMeta:
    """Spec module that builds the wrapped spec's module with its weights on the meta device."""

    def __new__(cls, *args, wrapped: ModuleSpec, **kwargs):
        with _EmptyOnMeta():
            return build_module(wrapped, *args, **kwargs)


def _tie_buffers(leader: torch.nn.Module, member: torch.nn.Module) -> None:
    """Buffers (e.g. a router's expert bias) follow the parameters: the member uses the leader's tensors."""
    for name, buffer in leader.named_buffers():
        *parents, leaf = name.split(".")
        owner = functools.reduce(getattr, parents, member)
        owner._buffers[leaf] = buffer


def grouped_sharded_state_dict(block: TransformerBlock, groups: int, prefix: str = "", sharded_offsets: tuple = (),
                               metadata: Optional[dict] = None) -> dict:
    """``block``'s sharded state dict in the pseudo layout: each sharing group's first layer only, stacked as layer
    g of ``groups`` (what TransformerBlock writes for a ``groups``-layer block), under its own module index.

    A pseudo block's L layers hold ``groups`` parameter sets: listing every layer would save each set L/groups
    times and give the optimizer, which maps each Parameter to one entry, a stacked tensor it holds only one slice
    of (an invalid access pattern in dist checkpointing). Applied to a real block of the same config it asks for
    that layout, so a pseudo checkpoint loads into the real model (``megatron_patches.delink``).
    """
    runs = sharing.sharing_groups(len(block.layers), groups)
    leaders = [block.layers[run[0]] for run in runs]
    saved = block.layers, block.config, [layer.layer_number for layer in leaders]
    grouped_config = copy.copy(block.config)
    grouped_config.num_layers = groups
    block.layers, block.config = torch.nn.ModuleList(leaders), grouped_config
    for g, layer in enumerate(leaders):
        layer.layer_number = g + 1
    try:
        sharded = TransformerBlock.sharded_state_dict(block, prefix, sharded_offsets, metadata)
    finally:
        block.layers, block.config = saved[0], saved[1]
        for layer, number in zip(leaders, saved[2]):
            layer.layer_number = number
    # TransformerBlock names the entries after the module index it saw (g); loading must reach the leader (run[0]).
    layer_prefix = f"{prefix}{LAYERS}."
    out = {}
    for key, value in sharded.items():
        if key.startswith(layer_prefix):
            index, rest = key[len(layer_prefix):].split(".", 1)
            key = f"{layer_prefix}{runs[int(index)][0]}.{rest}"
        out[key] = value
    return out


class SharedParameterTransformerBlock(TransformerBlock):
    """A TransformerBlock whose layers share parameters in ``groups`` runs of consecutive layers.

    Every layer keeps its own module and ``layer_number`` (1..L), so ``state_dict`` names each layer as the real
    model does. Its dist checkpoint holds each group's parameters once (``grouped_sharded_state_dict``); loading
    one, the other layers' entries are filled from their group's first layer.
    """

    def __init__(self, *args, groups: int = 1, **kwargs):
        object.__setattr__(self, "sharing_groups", groups)  # read by _build_layers, called inside super().__init__
        super().__init__(*args, **kwargs)
        self._register_load_state_dict_pre_hook(self._fill_member_layers)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return grouped_sharded_state_dict(self, self.sharing_groups, prefix, sharded_offsets, metadata)

    def _fill_member_layers(self, state_dict, prefix, *args):
        """A grouped checkpoint names only the leaders' tensors; a strict load_state_dict wants every layer's."""
        layer_keys = {k: v for k, v in state_dict.items() if k.startswith(f"{prefix}{LAYERS}.")}
        for key, value in sharing.expand_state_dict(layer_keys, LAYERS, len(self.layers), self.sharing_groups).items():
            state_dict.setdefault(key, value)

    def _build_layers(self):
        if self.config.pipeline_model_parallel_size > 1:
            # Groups would be formed per pipeline stage and their parameters reduced per stage: not built yet.
            raise NotImplementedError(
                f"shared-parameter block: --pipeline-model-parallel-size {self.config.pipeline_model_parallel_size} "
                f"is not supported; accepted: 1 (use tensor, data and expert parallelism)"
            )
        specs = list(self.submodules.layer_specs)
        runs = sharing.sharing_groups(len(specs), self.sharing_groups)
        leaders = {run[0] for run in runs}
        on_meta = [s if i in leaders else ModuleSpec(module=_BuildOnMeta, params={"wrapped": s}) for i, s in enumerate(specs)]
        full_submodules = self.submodules
        self.submodules = dataclasses.replace(full_submodules, layer_specs=on_meta)
        try:
            super()._build_layers()
        finally:
            self.submodules = full_submodules
        for run in runs:
            for i in run[1:]:
                sharing.tie_parameters(self.layers[run[0]], self.layers[i])
                _tie_buffers(self.layers[run[0]], self.layers[i])
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"shared block: tensors left on the meta device after tying: {left[:5]}")


@contextlib.contextmanager
def shared_parameter_decoder(groups: int = 1) -> Iterator[None]:
    """While open, GPTModel builds its decoder as a SharedParameterTransformerBlock with ``groups`` groups.

    GPTModel names TransformerBlock directly (gpt_model.py, megatron-core 0.16.1), so the name is swapped there
    and restored on exit; listed in ``megatron_patches.PATCHES``.
    """
    import megatron.core.models.gpt.gpt_model as gpt_model

    original = gpt_model.TransformerBlock
    gpt_model.TransformerBlock = functools.partial(SharedParameterTransformerBlock, groups=groups)
    try:
        yield
    finally:
        gpt_model.TransformerBlock = original


def delink_block(block: TransformerBlock) -> TransformerBlock:
    """Give every layer of ``block`` its own copy of the parameters it shares, in place.

    The copies keep Megatron's parameter attributes (tensor_model_parallel, partition_dim, sequence_parallel,
    allreduce...), which decide how gradients are reduced, but not those a DDP wrapper hung on the shared one.
    Use this on a bare model; a model wrapped in Megatron's DDP must be rebuilt instead
    (``megatron_patches.delink``): its grad hooks and buffers hold the old Parameters.
    """
    shared = {id(p) for p in block.parameters()}
    sharing.delink_layers(block, LAYERS)
    for param in block.parameters():
        if id(param) not in shared:
            for attr in _DDP_ONLY_ATTRS:
                param.__dict__.pop(attr, None)
    return block


# Attributes Megatron's DDP and optimizers hang on a Parameter; they belong to the old wrapper, not to the copy.
_DDP_ONLY_ATTRS = ("main_grad", "grad_added_to_main_grad", "main_param", "main_param_sharded")


def shared_groups_of(block: TransformerBlock) -> int:
    """How many distinct parameter sets the block's layers hold (1 = fully shared, L = real)."""
    return sharing.count_shared_groups(block, LAYERS)
