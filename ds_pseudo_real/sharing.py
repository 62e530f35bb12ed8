"""Sharing and delinking of a model's layer list, in plain torch.

Owns: finding the layer list by dotted path, grouping layers, tying a group's parameters to one set,
delinking them into independent copies, writing one shared value into its copies, copying a model with new
parameters (a meta skeleton), naming the parameter a stage's parameter starts from, and remapping state dicts
between the compact (pseudo) and the full (real) key layout. Must not touch DeepSpeed or Megatron: both build on
these functions.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from .config import ConfigError

# The piece of a shared value read once and written into all its copies while it is still in cache.
FILL_PIECE_BYTES = 4 << 20


def get_layer_list(model: nn.Module, path: str) -> nn.ModuleList:
    """Return the ``nn.ModuleList`` at dotted ``path`` (e.g. ``"layers"`` or ``"transformer.h"``)."""
    module = model
    for part in path.split("."):
        if not hasattr(module, part):
            raise ConfigError(
                f"pseudo_to_real.layers: {type(model).__name__} has no attribute path {path!r} "
                f"(stopped at {part!r}); name the model's layer list, e.g. 'layers' or 'transformer.h'"
            )
        module = getattr(module, part)
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(
            f"pseudo_to_real.layers: {path!r} is a {type(module).__name__}, expected an nn.ModuleList or nn.Sequential"
        )
    if len(module) == 0:
        raise ConfigError(f"pseudo_to_real.layers: {path!r} is empty")
    return module


def sharing_groups(num_layers: int, groups: int) -> List[range]:
    """Split ``num_layers`` into ``groups`` runs of consecutive layers of equal length."""
    if groups < 1 or num_layers % groups != 0:
        raise ConfigError(
            f"pseudo_to_real.groups: got {groups}; it must be >= 1 and divide the number of layers ({num_layers}); "
            f"accepted values: {[g for g in range(1, num_layers + 1) if num_layers % g == 0]}"
        )
    size = num_layers // groups
    return [range(g * size, (g + 1) * size) for g in range(groups)]


def groups_in_range(layers: range, num_layers: int, groups: int) -> List[Tuple[int, List[int]]]:
    """The sharing groups with layers in ``layers`` (global indices: a pipeline stage's share of the model), each
    with its layers' positions in ``layers``, in layer order: ``[(group, [position, ...]), ...]``."""
    out = []
    for g, run in enumerate(sharing_groups(num_layers, groups)):
        positions = [i - layers.start for i in run if i in layers]
        if positions:
            out.append((g, positions))
    return out


def group_leader(layer_index: int, num_layers: int, groups: int) -> int:
    """Index of the layer whose parameters ``layer_index`` uses in the pseudo model."""
    size = num_layers // groups
    return (layer_index // size) * size


def _check_same_structure(leader: nn.Module, member: nn.Module, index: int) -> None:
    lead = [(n, p.shape) for n, p in leader.named_parameters(remove_duplicate=False)]
    mem = [(n, p.shape) for n, p in member.named_parameters(remove_duplicate=False)]
    if lead != mem:
        raise ValueError(f"layer {index} does not have the same parameter names and shapes as its group's first layer")


def _owning_module(root: nn.Module, dotted: str):
    *parents, leaf = dotted.split(".")
    module = root
    for name in parents:
        module = getattr(module, name)
    return module, leaf


def tie_parameters(leader: nn.Module, member: nn.Module) -> None:
    """Point every parameter of ``member`` at the same-named Parameter object of ``leader``."""
    for name, param in list(leader.named_parameters(remove_duplicate=False)):
        owner, leaf = _owning_module(member, name)
        owner._parameters[leaf] = param


def apply_sharing(model: nn.Module, path: str, groups: int = 1) -> nn.Module:
    """Tie the layers of ``model.<path>`` so that each of ``groups`` runs of consecutive layers uses one parameter set.

    Layers stay distinct module objects (hooks, layer numbers and state-dict keys are kept); only their
    Parameter objects are shared. The group's first layer keeps its values; the others' are dropped.
    """
    layers = get_layer_list(model, path)
    for run in sharing_groups(len(layers), groups):
        leader = layers[run[0]]
        for i in run[1:]:
            _check_same_structure(leader, layers[i], i)
            tie_parameters(leader, layers[i])
    return model


def parameter_like(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A new Parameter holding ``data`` that keeps ``param``'s requires_grad and its Python attributes
    (e.g. DeepSpeed MoE marks expert parameters with ``allreduce``/``group_name``)."""
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def copy_with_parameters(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> nn.Module:
    """Deep copy of ``model`` whose parameters are ``make(param)`` (ties kept; buffers copied).

    Pre-seeding ``deepcopy``'s memo keeps Parameter attributes that ``Parameter.__deepcopy__`` drops and never
    copies the parameters' data. The process groups the modules hold are shared by the copy, not copied (torch
    cannot copy them; a tensor-parallel layer holds its group, Megatron's in ``tp_group`` and ``pg_collection``).
    """
    memo: Dict[int, Any] = {id(group): group for group in _held_process_groups(model)}
    for param in model.parameters():
        memo[id(param)] = make(param)
    return copy.deepcopy(model, memo)


def _held_process_groups(model: nn.Module) -> List[Any]:
    """The ``torch.distributed`` process groups ``model``'s modules hold as attributes, or inside an object held as
    one (a collection of groups)."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    found = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (nn.Module, torch.Tensor, dict, list, tuple)):
                continue  # submodules are visited themselves; torch's own dicts hold parameters, buffers, hooks
            inner = list(vars(value).values()) if hasattr(value, "__dict__") else []
            found += [v for v in (value, *inner) if isinstance(v, dist.ProcessGroup)]
    return found


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (ties kept, buffers real): a building plan."""
    return copy_with_parameters(model, lambda p: parameter_like(p, torch.empty_like(p, device="meta")))


def fill_copies(targets: Sequence[torch.Tensor], source: torch.Tensor) -> None:
    """Write ``source`` into every tensor of ``targets`` (its shape; any dtype and device), reading each piece of it
    once for all of them: a piece of ``FILL_PIECE_BYTES`` is written into every target (moved once to each other
    device that has targets) before the next piece is read. Copying the source into one target after another reads
    all of it once per target, a third of the bytes a delink that carries Adam moments moves."""
    for target in targets:
        if target.shape != source.shape:
            raise ValueError(f"a copy of shape {tuple(target.shape)} for a source of shape {tuple(source.shape)}")
    flat = source.detach().reshape(-1)
    step = max(1, FILL_PIECE_BYTES // flat.element_size())
    with torch.no_grad():
        whole = [t for t in targets if not t.is_contiguous()]  # no flat view to write pieces into
        for target in whole:
            target.copy_(source)
        outs = [t.detach().view(-1) for t in targets if t.is_contiguous()]
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            moved = {piece.device: piece}
            for out in outs:
                if out.device not in moved:
                    moved[out.device] = piece.to(out.device)
                out[start:start + step].copy_(moved[out.device])


def delink_layers(model: nn.Module, path: str) -> nn.Module:
    """Give every layer of ``model.<path>`` its own copy of any Parameter it shares with an earlier layer."""
    layers = get_layer_list(model, path)
    seen = set()
    for layer in layers:
        for name, param in list(layer.named_parameters(remove_duplicate=False)):
            if id(param) in seen:
                owner, leaf = _owning_module(layer, name)
                owner._parameters[leaf] = parameter_like(param, param.detach().clone())
        seen.update(id(p) for p in layer.parameters())
    return model


def truncate_layers(model: nn.Module, path: str, depth: int) -> nn.Module:
    """Keep the first ``depth`` layers of ``model.<path>`` (a shallow model; the layer objects are kept)."""
    layers = get_layer_list(model, path)
    owner, leaf = _owning_module(model, path)
    setattr(owner, leaf, type(layers)(list(layers)[:depth]))
    return model


def count_shared_groups(model: nn.Module, path: str) -> int:
    """How many distinct parameter sets the layer list holds (1 = fully shared, L = real)."""
    layers = get_layer_list(model, path)
    sets = {tuple(id(p) for p in layer.parameters()) for layer in layers}
    return len(sets)


def _layer_key_pattern(path: str) -> re.Pattern:
    return re.compile(r"^(?P<prefix>(?:.*\.)?" + re.escape(path) + r")\.(?P<index>\d+)\.(?P<rest>.+)$")


def compact_state_dict(state: Mapping[str, torch.Tensor], path: str, num_layers: int, groups: int) -> Dict[str, torch.Tensor]:
    """Keep only the group leaders' layer keys: the pseudo model's unique parameters."""
    pattern = _layer_key_pattern(path)
    out = {}
    for key, value in state.items():
        match = pattern.match(key)
        if match and int(match["index"]) != group_leader(int(match["index"]), num_layers, groups):
            continue
        out[key] = value
    return out


def expand_state_dict(
    state: Mapping[str, torch.Tensor], path: str, num_layers: int, groups: int, clone: bool = False
) -> Dict[str, torch.Tensor]:
    """Fill every layer's keys from its group leader's: a pseudo state dict in the real model's key layout.

    Keys of non-leader layers already present are replaced by the leader's values, so both a compact and a
    full pseudo state dict (where tied parameters appear under every layer's name) map to the same result.
    """
    pattern = _layer_key_pattern(path)
    out = {}
    leaders = {}
    for key, value in state.items():
        match = pattern.match(key)
        if not match:
            out[key] = value
            continue
        index = int(match["index"])
        if index == group_leader(index, num_layers, groups):
            leaders[(match["prefix"], index, match["rest"])] = value
    for (prefix, leader, rest), value in leaders.items():
        size = num_layers // groups
        for i in range(leader, leader + size):
            out[f"{prefix}.{i}.{rest}"] = value.clone() if clone and i != leader else value
    return out


def layer_index_of(key: str, path: str) -> int | None:
    """The layer index a state-dict or parameter name belongs to, or None for non-layer parameters."""
    match = _layer_key_pattern(path).match(key)
    return int(match["index"]) if match else None


def source_parameter(name: str, path: str, old: Tuple[int, int], new: Tuple[int, int]) -> Tuple[str, int]:
    """The parameter of the ``old`` stage's model (layers, parameter groups) that ``name``, a parameter of the
    ``new`` stage's model, starts from, and how many of the new sets split each old one: a group's first layer
    when the sets split (their number), the same layer of the stacked copy when a shallow model grows (1)."""
    index = layer_index_of(name, path)
    if index is None:
        return name, 1
    (depth, groups), (new_depth, new_groups) = old, new
    if new_depth > depth:
        source, members = index % depth, 1
    else:
        source, members = group_leader(index, depth, groups), new_groups // groups
    prefix = f"{path}.{index}."
    position = name.index(prefix)
    return name[:position] + f"{path}.{source}." + name[position + len(prefix):], members


def unique_parameters(modules: Iterable[nn.Module]) -> List[nn.Parameter]:
    """Parameters of ``modules`` without repeats, in first-seen order."""
    seen, out = set(), []
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def parameter_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (shared ones counted once)."""
    return sum(p.numel() for p in unique_parameters([model]))


def member_counts(model: nn.Module, path: str) -> Dict[str, int]:
    """For each unique parameter name (``named_parameters`` order), how many layers use it (1 outside the layer list)."""
    layers = get_layer_list(model, path)
    uses: Dict[int, int] = {}
    for layer in layers:
        for param in set(layer.parameters()):
            uses[id(param)] = uses.get(id(param), 0) + 1
    return {name: uses.get(id(p), 1) for name, p in model.named_parameters()}


__all__: Sequence[str] = [
    "get_layer_list",
    "sharing_groups",
    "groups_in_range",
    "group_leader",
    "tie_parameters",
    "apply_sharing",
    "delink_layers",
    "parameter_like",
    "copy_with_parameters",
    "meta_skeleton",
    "count_shared_groups",
    "compact_state_dict",
    "expand_state_dict",
    "layer_index_of",
    "source_parameter",
    "unique_parameters",
    "parameter_count",
    "member_counts",
]
