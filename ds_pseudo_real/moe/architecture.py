"""The M6 architecture as data: a small dataclass, its per-layer parameter counts, and a meta-device builder.

Owns: the M6-10T / M6-1T-like / tiny descriptions and the arithmetic on them (what an offload planner needs:
a plain list of per-layer parameter counts, for the real and the pseudo model). Must not train anything:
``build_meta_model`` lays out the parameters for counting and planning, it is not a runnable model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

import torch
from torch import nn

from ds_pseudo_real import sharing
from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.moe.routing import check_prototypes


@dataclass(frozen=True)
class M6Architecture:
    """Every layer is attention + an MoE of ``num_experts`` experts in ``num_prototypes`` prototypes.

    Linear layers have no bias (the M6 expert count is 2 x hidden x ffn per expert); LayerNorms have weight and
    bias; positions are learned; the output head is tied to the word embedding. ``vocab_size`` and ``seq_length``
    are choices: the sources for M6-10T do not fix them.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    expert_ffn_size: int
    num_experts: int
    num_prototypes: int
    vocab_size: int
    seq_length: int

    def __post_init__(self):
        check_prototypes(self.num_experts, self.num_prototypes)
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"m6.hidden_size {self.hidden_size} is not divisible by m6.num_heads {self.num_heads}")


# 48 x 10240 x 2 x 1024 x 9984 = 1.005e13 expert parameters; vocabulary (BERT-Chinese size) and sequence length chosen.
M6_10T = M6Architecture("m6-10t", num_layers=48, hidden_size=1024, num_heads=16, expert_ffn_size=9984,
                        num_experts=10240, num_prototypes=80, vocab_size=21128, seq_length=512)
# The M6-T 1T shape (24 layers, 960 experts of FFN 21248); the 4 prototypes are a choice.
M6_1T_LIKE = M6Architecture("m6-1t-like", num_layers=24, hidden_size=1024, num_heads=16, expert_ffn_size=21248,
                            num_experts=960, num_prototypes=4, vocab_size=21128, seq_length=512)
M6_TINY = M6Architecture("m6-tiny", num_layers=4, hidden_size=64, num_heads=4, expert_ffn_size=128,
                         num_experts=8, num_prototypes=2, vocab_size=128, seq_length=32)
PRESETS = {arch.name: arch for arch in (M6_10T, M6_1T_LIKE, M6_TINY)}


def expert_parameters_per_layer(arch: M6Architecture, expert_parallel: int = 1) -> int:
    """Expert parameters of one layer held by one rank when experts are spread over ``expert_parallel`` ranks."""
    if expert_parallel < 1 or arch.num_experts % expert_parallel:
        raise ValueError(f"expert_parallel: got {expert_parallel}; it must divide the {arch.num_experts} experts")
    return arch.num_experts // expert_parallel * 2 * arch.hidden_size * arch.expert_ffn_size


def dense_parameters_per_layer(arch: M6Architecture) -> int:
    """Attention (qkv + output projection), two LayerNorms and the router."""
    h = arch.hidden_size
    return 4 * h * h + 2 * 2 * h + arch.num_experts * h


def layer_parameters(arch: M6Architecture, expert_parallel: int = 1) -> int:
    return dense_parameters_per_layer(arch) + expert_parameters_per_layer(arch, expert_parallel)


def embedding_parameters(arch: M6Architecture) -> int:
    """Word + position embeddings and the final LayerNorm (the head is tied)."""
    return (arch.vocab_size + arch.seq_length) * arch.hidden_size + 2 * arch.hidden_size


def layer_parameter_counts(arch: M6Architecture, groups: Optional[int] = None, expert_parallel: int = 1) -> List[int]:
    """Parameters each layer owns on one rank, in layer order: the offload planner's input. With ``groups`` (the
    pseudo model) each group's first layer owns the shared set and the others own 0."""
    size = layer_parameters(arch, expert_parallel)
    if groups is None:
        return [size] * arch.num_layers
    leaders = {run[0] for run in sharing.sharing_groups(arch.num_layers, groups)}
    return [size if i in leaders else 0 for i in range(arch.num_layers)]


def total_parameters(arch: M6Architecture, groups: Optional[int] = None) -> int:
    return embedding_parameters(arch) + sum(layer_parameter_counts(arch, groups))


def active_parameters_per_token(arch: M6Architecture) -> int:
    """Parameters a token meets in the forward: every layer's dense part and one expert in each prototype (top-1
    routing inside each), and the embeddings (the head is tied); the same for the pseudo model, whose layers share."""
    expert = 2 * arch.hidden_size * arch.expert_ffn_size
    per_layer = dense_parameters_per_layer(arch) + arch.num_prototypes * expert
    return arch.num_layers * per_layer + embedding_parameters(arch)


def architecture_from_dict(raw: Mapping[str, Any]) -> M6Architecture:
    """An architecture from a config section: ``{"preset": "m6-10t", ...overrides}`` or every field given."""
    raw = dict(raw)
    fields = {f.name for f in dataclasses.fields(M6Architecture)}
    unknown = sorted(set(raw) - fields - {"preset"})
    if unknown:
        raise ConfigError(f"m6: unknown key(s) {unknown}; accepted: {sorted(fields | {'preset'})}")
    preset = raw.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"m6.preset: got {preset!r}, expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[preset], **raw)
    return M6Architecture(**raw)


class ExpertBank(nn.Module):
    """The experts of one layer as two stacked weights: ``[E, hidden, ffn]`` and ``[E, ffn, hidden]``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.fc2 = nn.Parameter(torch.empty(num_experts, ffn, hidden))


class M6Layer(nn.Module):
    def __init__(self, arch: M6Architecture):
        super().__init__()
        h = arch.hidden_size
        self.input_norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.LayerNorm(h)
        self.router = nn.Linear(h, arch.num_experts, bias=False)
        self.experts = ExpertBank(arch.num_experts, h, arch.expert_ffn_size)


class M6Model(nn.Module):
    def __init__(self, arch: M6Architecture):
        super().__init__()
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(arch.seq_length, arch.hidden_size)
        self.layers = nn.ModuleList(M6Layer(arch) for _ in range(arch.num_layers))
        self.final_norm = nn.LayerNorm(arch.hidden_size)


def build_meta_model(arch: M6Architecture, groups: Optional[int] = None) -> M6Model:
    """The parameter layout of ``arch`` on the meta device (no memory); with ``groups``, the pseudo model."""
    with torch.device("meta"):
        model = M6Model(arch)
    if groups is not None:
        sharing.apply_sharing(model, "layers", groups)
    return model
