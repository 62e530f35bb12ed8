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
from typing import Iterator, List, Optional, Tuple

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank
from torch.overrides import TorchFunctionMode

from ds_pseudo_real import sharing
from megatron_patches import stage_copies

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


def local_groups(block: TransformerBlock, groups: int) -> List[Tuple[int, List[int]]]:
    """The sharing groups with layers in ``block`` (one pipeline stage's, or virtual stage's, share of the model),
    each with the module indices of its layers there (``sharing.groups_in_range``)."""
    offset = get_transformer_layer_offset(block.config, block.vp_stage, get_pg_rank(block.pg_collection.pp))
    return sharing.groups_in_range(range(offset, offset + len(block.submodules.layer_specs)), block.config.num_layers,
                                   groups)


def grouped_sharded_state_dict(block: TransformerBlock, groups: int, prefix: str = "", sharded_offsets: tuple = (),
                               metadata: Optional[dict] = None) -> dict:
    """``block``'s sharded state dict in the pseudo layout: the first layer it holds of each sharing group only,
    stacked as layer g of ``groups`` (what TransformerBlock writes for a ``groups``-layer block without pipeline
    parallelism), under its own module index. A copy of a set that another stage holds too (``stage_copies``) is
    marked a replica, as Megatron marks the last stage's copy of tied embeddings.

    A pseudo block's L layers hold ``groups`` parameter sets: listing every layer would save each set L/groups
    times and give the optimizer, which maps each Parameter to one entry, a stacked tensor it holds only one slice
    of (an invalid access pattern in dist checkpointing). Applied to a real block of the same config it asks for
    that layout, so a pseudo checkpoint loads into the real model (``megatron_patches.delink``).
    """
    held = local_groups(block, groups)
    leaders = [block.layers[positions[0]] for _, positions in held]
    saved = block.layers, block.config, [layer.layer_number for layer in leaders]
    # The offset TransformerBlock adds for pipeline stages is 0 for this one-stage config of ``groups`` layers.
    grouped_config = copy.copy(block.config)
    grouped_config.num_layers = groups
    grouped_config.pipeline_model_parallel_size = 1
    block.layers, block.config = torch.nn.ModuleList(leaders), grouped_config
    for layer, (g, _) in zip(leaders, held):
        layer.layer_number = g + 1
    try:
        sharded = TransformerBlock.sharded_state_dict(block, prefix, sharded_offsets, metadata)
    finally:
        block.layers, block.config = saved[0], saved[1]
        for layer, number in zip(leaders, saved[2]):
            layer.layer_number = number
    # TransformerBlock names the entries after the layer number it saw (g + 1); loading must reach the leader.
    layer_prefix = f"{prefix}{LAYERS}."
    leader_of = {g: positions[0] for g, positions in held}
    out = {}
    for key, value in sharded.items():
        if key.startswith(layer_prefix):
            g, rest = key[len(layer_prefix):].split(".", 1)
            key = f"{layer_prefix}{leader_of[int(g)]}.{rest}"
        out[key] = value
    copies = getattr(block, "stage_copies", None)
    if copies is not None:
        positions = {layer: position for position, layer in enumerate(block.layers)}
        for layer, copy_index in copies.layers.values():
            if copy_index:
                _mark_replica(out, f"{layer_prefix}{positions[layer]}.", copy_index)
    return out


def _mark_replica(sharded: dict, key_prefix: str, copy_index: int) -> None:
    """Entries under ``key_prefix`` become replica ``copy_index`` along the pipeline (the first element of a
    ShardedTensor's replica id), as ``LanguageModule.tie_embeddings_and_output_weights_state_dict`` marks the last
    stage's embedding: saved by the first copy only, loaded by all."""
    for key, entry in sharded.items():
        if key.startswith(key_prefix):
            replica = entry.replica_id
            entry.replica_id = (copy_index, *replica[1:]) if isinstance(replica, tuple) else copy_index


class SharedParameterTransformerBlock(TransformerBlock):
    """A TransformerBlock whose layers share parameters in ``groups`` runs of consecutive layers.

    Every layer keeps its own module and ``layer_number`` (1..L), so ``state_dict`` names each layer as the real
    model does. Its dist checkpoint holds each group's parameters once (``grouped_sharded_state_dict``); loading
    one, the other layers' entries are filled from their group's first layer. With pipeline parallelism the block
    holds its stage's layers, and a group split between stages has a copy on each (``stage_copies``: its layer and
    copy index in ``self.stage_copies``; the run calls ``stage_copies.connect`` once every chunk is built).
    """

    def __init__(self, *args, groups: int = 1, **kwargs):
        object.__setattr__(self, "sharing_groups", groups)  # read by _build_layers, called inside super().__init__
        super().__init__(*args, **kwargs)
        self._register_load_state_dict_pre_hook(self._fill_member_layers)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return grouped_sharded_state_dict(self, self.sharing_groups, prefix, sharded_offsets, metadata)

    def _fill_member_layers(self, state_dict, prefix, *args):
        """A grouped checkpoint names only the leaders' tensors; a strict load_state_dict wants every layer's."""
        for _, positions in self.held_groups:
            leader = f"{prefix}{LAYERS}.{positions[0]}."
            for key in [k for k in state_dict if k.startswith(leader)]:
                for i in positions[1:]:
                    state_dict.setdefault(f"{prefix}{LAYERS}.{i}.{key[len(leader):]}", state_dict[key])

    def _build_layers(self):
        held = local_groups(self, self.sharing_groups)
        object.__setattr__(self, "held_groups", held)
        leaders = {positions[0] for _, positions in held}
        on_meta = [s if i in leaders else ModuleSpec(module=_BuildOnMeta, params={"wrapped": s})
                   for i, s in enumerate(self.submodules.layer_specs)]
        full_submodules = self.submodules
        self.submodules = dataclasses.replace(full_submodules, layer_specs=on_meta)
        try:
            super()._build_layers()
        finally:
            self.submodules = full_submodules
        for _, positions in held:
            for i in positions[1:]:
                sharing.tie_parameters(self.layers[positions[0]], self.layers[i])
                _tie_buffers(self.layers[positions[0]], self.layers[i])
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"shared block: tensors left on the meta device after tying: {left[:5]}")
        self._mark_stage_copies(held)

    def _mark_stage_copies(self, held: List[Tuple[int, List[int]]]) -> None:
        """Groups only partly in this block have copies elsewhere (other stages, or this rank's other virtual
        stages); the copy index is the distance of this block's first layer of the group from the group's first."""
        size = self.config.num_layers // self.sharing_groups
        offset = get_transformer_layer_offset(self.config, self.vp_stage, get_pg_rank(self.pg_collection.pp))
        copies = {}
        for g, positions in held:
            if len(positions) < size:
                copies[g] = (self.layers[positions[0]], offset + positions[0] - g * size)
                stage_copies.mark_copy(*copies[g])
        if copies and self.config.moe_router_enable_expert_bias:
            raise NotImplementedError(
                "shared-parameter block: --moe-router-enable-expert-bias with a sharing group split between "
                "pipeline stages is not supported (each stage would update the shared bias from its own layers' "
                "tokens); accepted: no expert bias, or --pseudo-to-real-groups a multiple of "
                "--pipeline-model-parallel-size")
        object.__setattr__(self, "stage_copies", stage_copies.StageCopies(copies, self.pg_collection.pp)
                           if copies else None)


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
