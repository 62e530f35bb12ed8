"""Copies of a shared parameter set on several pipeline stages: one set, however many stages hold its layers.

Owns: marking the copies a pseudo block holds, the process groups over the ranks holding copies of one set, giving
every copy the first copy's values, and summing the copies' gradients before the optimizer step. Which copies a
block holds is ``shared_block``'s. Megatron keeps the word embeddings tied between the first and the last stage this
way (megatron-core 0.16.1), and each step here is its counterpart: the copies start from the first one's values
(``LanguageModule.setup_embeddings_and_output_layer``: zero the other copy, all-reduce over the embedding group);
gradients are summed over the holding ranks after the data-parallel reduction
(``finalize_model_grads._allreduce_embedding_grad``); every copy but the first is marked ``shared``, so the gradient
norm counts the set once (``param_is_not_shared``); every copy is marked ``shared_embedding``, which gives each of its
parameters a bucket of its own under the distributed optimizer (``_ParamAndGradBuffer``), so every stage shards it
alike and the data-parallel reduce-scatter may come first. Megatron-LM builds its embedding groups from every
pipeline group (``initialize_model_parallel``, every rank creating every group); ``connect`` does that for the
copies, from what each rank reports it holds.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@dataclass
class StageCopies:
    """The copies one model chunk holds: sharing group -> (the chunk's layer holding it, its copy index: 0 for the
    copy holding the group's first layer), and, once ``connect`` ran, the process group over the ranks holding one
    (none where this rank holds them all)."""

    layers: Dict[int, Tuple[torch.nn.Module, int]]
    pipeline_group: object
    process_groups: Dict[int, object] = field(default_factory=dict)


def mark_copy(layer: torch.nn.Module, copy_index: int) -> None:
    """Mark a copy's parameters as Megatron marks the tied embedding's (see the module docstring)."""
    for param in layer.parameters():
        param.shared_embedding = True
        if copy_index:
            param.shared = True


@dataclass(frozen=True)
class Holding:
    """What one rank reports to the others: its pipeline group's ranks and the sharing groups it holds copies of."""

    rank: int
    pipeline: Tuple[int, ...]
    groups: FrozenSet[int]


def copy_group_ranks(holdings: Sequence[Holding]) -> List[Tuple[int, Tuple[int, ...]]]:
    """(sharing group, the ranks of one pipeline group holding a copy of it) for every set held on more than one
    rank, sorted: the order in which every rank creates the process groups."""
    holders: Dict[Tuple[Tuple[int, ...], int], List[int]] = {}
    for holding in holdings:
        for g in holding.groups:
            holders.setdefault((holding.pipeline, g), []).append(holding.rank)
    return sorted((g, tuple(sorted(ranks))) for (_, g), ranks in holders.items() if len(ranks) > 1)


def _chunk_copies(model_chunks: Sequence[torch.nn.Module]) -> List[StageCopies]:
    return [m.stage_copies for chunk in model_chunks for m in chunk.modules()
            if isinstance(getattr(m, "stage_copies", None), StageCopies)]


def holds_copies(model_chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether this rank's chunks hold a copy of a set that other stages (or virtual stages) hold too."""
    return bool(_chunk_copies(model_chunks))


def _held(copies: Sequence[StageCopies]) -> Dict[int, List[Tuple[torch.nn.Module, int]]]:
    held: Dict[int, List[Tuple[torch.nn.Module, int]]] = {}
    for chunk in copies:
        for g, copy in chunk.layers.items():
            held.setdefault(g, []).append(copy)
    return held


def connect(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Create the process groups over each set's copies and give every copy the first copy's values.

    Collective over every rank of the job, once its model chunks (all virtual stages) are built and before the
    optimizer is: call it on every rank, whatever it holds. Nothing to do without pipeline parallelism."""
    copies = _chunk_copies(model_chunks)
    if not copies:
        return
    pipeline = copies[0].pipeline_group
    held = _held(copies)
    groups: Dict[int, object] = {}
    if pipeline.size() > 1:
        reports: List[Optional[Holding]] = [None] * dist.get_world_size()
        me = dist.get_rank()
        dist.all_gather_object(reports, Holding(me, tuple(dist.get_process_group_ranks(pipeline)), frozenset(held)))
        for g, ranks in copy_group_ranks(reports):
            group = dist.new_group(list(ranks))  # every rank creates every group, in the same order
            if me in ranks:
                groups[g] = group
    for chunk in copies:
        chunk.process_groups = groups
    with torch.no_grad():
        for g in sorted(held):
            first = [layer for layer, index in held[g] if index == 0]
            value = _flatten_dense_tensors([p.data for p in (first or [held[g][0][0]])[0].parameters()])
            if not first:  # the sum over the holders is then the first copy's values
                value.zero_()
            if g in groups:
                dist.all_reduce(value, group=groups[g])
            for layer, _ in held[g]:
                targets = [p.data for p in layer.parameters()]
                for target, synced in zip(targets, _unflatten_dense_tensors(value, targets)):
                    target.copy_(synced)


def _grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def reduce_gradients(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Sum every shared set's gradient over its copies (this rank's chunks, then the ranks holding the others),
    into every copy. After the data-parallel reduction, on every rank (a collective per set held on several)."""
    copies = _chunk_copies(model_chunks)
    if not copies:
        return
    groups = copies[0].process_groups
    held = _held(copies)
    for g in sorted(held):
        grads = [[_grad(p) for p in layer.parameters()] for layer, _ in held[g]]
        if any(grad is None for grad in grads[0]):  # frozen
            continue
        total = _flatten_dense_tensors(grads[0])
        for other in grads[1:]:
            total += _flatten_dense_tensors(other)
        if g in groups:
            dist.all_reduce(total, group=groups[g])
        for copy in grads:
            for buf, synced in zip(copy, _unflatten_dense_tensors(total, copy)):
                buf.copy_(synced)


def with_copies_reduced(finalize_model_grads: Callable) -> Callable:
    """``finalize_model_grads`` (megatron.core's: data-parallel, sequence-parallel and embedding reductions)
    followed by ``reduce_gradients``: what ``config.finalize_model_grads_func`` must be for a pseudo model with
    pipeline parallelism."""

    def finalize_model_grads_with_copies(model, *args, **kwargs):
        out = finalize_model_grads(model, *args, **kwargs)
        reduce_gradients(model)
        return out

    return finalize_model_grads_with_copies


def load_each_shard_once(load: Callable) -> Callable:
    """A dist checkpointing load strategy's ``load(self, sharded_state_dict, checkpoint_dir)`` that asks the
    checkpoint once for a shard this rank requests several times, and gives every request the values: a rank
    holding copies of a set in several virtual stages requests each of its tensors once per copy, and torch_dist
    refuses overlapping shards of one tensor on one rank ("Shards ... overlap")."""

    def load_each_once(self, sharded_state_dict, checkpoint_dir):
        first: Dict[tuple, tuple] = {}
        repeats = []
        for path, entry in _sharded_entries(sharded_state_dict, ()):
            shard = _shard_of(entry)
            if shard in first:
                repeats.append((path, first[shard]))
            else:
                first[shard] = path
        for path, _ in repeats:
            for depth in range(len(path), 0, -1):  # the entry, then what it leaves empty (loading drops those)
                parent = _container(sharded_state_dict, path[:depth])
                if depth < len(path) and parent[path[depth - 1]]:
                    break
                del parent[path[depth - 1]]
        loaded = load(self, sharded_state_dict, checkpoint_dir)
        for path, source in repeats:
            value = _container(loaded, source)[source[-1]]
            _container(loaded, path, create=True)[path[-1]] = (value.clone() if torch.is_tensor(value)
                                                               else copy.deepcopy(value))
        return loaded

    return load_each_once


def _sharded_entries(tree, path: tuple):
    """(path of dict keys, entry) for every ShardedTensor and ShardedObject reachable through dicts."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _sharded_entries(value, (*path, key))
        elif isinstance(value, (ShardedTensor, ShardedObject)):
            yield (*path, key), value


def _shard_of(entry) -> tuple:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(entry, ShardedObject):
        return ("object", entry.unique_key)
    return entry.key, tuple(entry.global_offset), tuple(entry.local_shape), entry.flattened_range


def _container(tree: dict, path: tuple, create: bool = False) -> dict:
    for key in path[:-1]:
        tree = tree.setdefault(key, {}) if create else tree[key]
    return tree
