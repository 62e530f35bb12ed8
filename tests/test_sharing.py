"""The model-agnostic sharing core: tying, delinking, key remapping, gradients of shared layers."""
import pytest
import torch
from torch import nn

from ds_pseudo_real.models import GPT, GPTConfig
from ds_pseudo_real.sharing import (
    apply_sharing,
    compact_state_dict,
    count_shared_groups,
    delink_layers,
    expand_state_dict,
    get_layer_list,
    member_counts,
    parameter_count,
    sharing_groups,
)

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops

CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16)


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def per_layer(model):
    return sum(p.numel() for p in model.layers[0].parameters())


def test_sharing_groups_split_consecutive_layers():
    assert sharing_groups(8, 2) == [range(0, 4), range(4, 8)]
    with pytest.raises(ValueError, match=r"pseudo_to_real.groups: got 3.*accepted values: \[1, 2, 4, 8\]"):
        sharing_groups(8, 3)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_apply_sharing_ties_groups_and_counts_parameters(groups):
    model = gpt()
    full = parameter_count(model)
    apply_sharing(model, "layers", groups)
    assert count_shared_groups(model, "layers") == groups
    assert parameter_count(model) == full - (4 - groups) * per_layer(model)
    size = 4 // groups
    for i, layer in enumerate(model.layers):
        assert layer.fc.weight is model.layers[(i // size) * size].fc.weight
    counts = member_counts(model, "layers")
    assert counts["layers.0.fc.weight"] == size and counts["tok_emb.weight"] == 1


def test_pseudo_forward_equals_reusing_the_first_layer():
    model = gpt()
    x = torch.randint(0, 256, (2, 16))
    apply_sharing(model, "layers", 1)
    manual = model.tok_emb(x) + model.pos_emb(torch.arange(16))
    for _ in range(4):
        manual = model.layers[0](manual)
    manual = model.head(model.ln_f(manual))
    assert torch.equal(model(x), manual)


def test_delink_gives_independent_copies_with_identical_logits():
    model = apply_sharing(gpt(), "layers", 2)
    x = torch.randint(0, 256, (2, 16))
    before = model(x)
    delink_layers(model, "layers")
    assert count_shared_groups(model, "layers") == 4
    assert torch.equal(model(x), before)
    with torch.no_grad():
        model.layers[1].fc.weight.add_(1.0)
    assert not torch.equal(model.layers[0].fc.weight, model.layers[1].fc.weight)
    assert torch.equal(model.layers[2].fc.weight, model.layers[3].fc.weight)


def test_shared_gradient_is_the_sum_of_the_delinked_layers_gradients():
    pseudo = apply_sharing(gpt(), "layers", 1)
    real = delink_layers(apply_sharing(gpt(), "layers", 1), "layers")
    x = torch.randint(0, 256, (2, 16))
    pseudo(x, x).backward()
    real(x, x).backward()
    total = sum(real.layers[i].fc.weight.grad for i in range(4))
    torch.testing.assert_close(pseudo.layers[0].fc.weight.grad, total, rtol=1e-5, atol=1e-7)


def test_state_dict_remapping_both_ways():
    pseudo = apply_sharing(gpt(), "layers", 2)
    full = pseudo.state_dict()  # tied parameters appear under every layer's name
    compact = compact_state_dict(full, "layers", 4, 2)
    assert {k.split(".")[1] for k in compact if k.startswith("layers.")} == {"0", "2"}
    expanded = expand_state_dict(compact, "layers", 4, 2)
    assert expanded.keys() == full.keys()
    assert all(torch.equal(expanded[k], full[k]) for k in full)
    real = gpt(seed=1)
    real.load_state_dict(expanded)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(real(x), pseudo(x))


def test_layer_list_by_dotted_path_and_clear_errors():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.h = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.transformer.wte = nn.Linear(4, 4)

    model = Wrapped()
    assert len(get_layer_list(model, "transformer.h")) == 2
    apply_sharing(model, "transformer.h", 1)
    assert model.transformer.h[1].weight is model.transformer.h[0].weight
    with pytest.raises(ValueError, match="no attribute path 'transformer.blocks'"):
        get_layer_list(model, "transformer.blocks")
    with pytest.raises(ValueError, match="is a Linear, expected an nn.ModuleList"):
        get_layer_list(model, "transformer.wte")


class SourceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (element offset, elements) of every copy that reads ``source``'s storage, in order."""

    def __init__(self, source):
        super().__init__()
        self.pointer, self.reads = source.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            read = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if read.untyped_storage().data_ptr() == self.pointer:
                self.reads.append((read.storage_offset(), read.numel()))
        return func(*args, **(kwargs or {}))


def test_fill_copies_reads_each_piece_of_the_source_once_for_all_its_copies(monkeypatch):
    """A piece of the source (16 fp32 elements here) is written into every copy before the next piece is read, so
    it is read from memory once for all of them; the copies equal the source in their own dtype, and a copy of
    another shape is refused before anything is written."""
    from ds_pseudo_real import sharing

    monkeypatch.setattr(sharing, "FILL_PIECE_BYTES", 64)
    source = torch.randn(10, 7)
    targets = [torch.empty(10, 7) for _ in range(3)] + [torch.empty(10, 7, dtype=torch.bfloat16)]
    with SourceReads(source) as recorded:
        sharing.fill_copies(targets, source)
    assert all(torch.equal(t, source.to(t.dtype)) for t in targets)
    pieces = [(start, min(16, 70 - start)) for start in range(0, 70, 16)]
    assert recorded.reads == [piece for piece in pieces for _ in targets]  # each piece, every copy, in turn
    with pytest.raises(ValueError, match=r"a copy of shape \(7, 10\) for a source of shape \(10, 7\)"):
        sharing.fill_copies([torch.empty(10, 7), torch.empty(7, 10)], source)


def test_the_real_model_is_built_reading_each_shared_value_once_for_all_its_layers(monkeypatch):
    """materialize fills the layers that start from one shared tensor together (fill_copies), not one layer after
    another: the same values, each piece of the shared tensor read once for its four layers."""
    from ds_pseudo_real import sharing
    from ds_pseudo_real.stages import materialize

    monkeypatch.setattr(sharing, "FILL_PIECE_BYTES", 256)
    with torch.device("meta"):
        skeleton = GPT(CFG)
    shared = torch.randn(skeleton.layers[0].fc.weight.shape)
    weights = {name: torch.randn(p.shape) for name, p in skeleton.named_parameters()}
    for i in range(4):
        weights[f"layers.{i}.fc.weight"] = shared
    with SourceReads(shared) as recorded:
        model = materialize(skeleton, weights)
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert len(recorded.reads) == 4 * (shared.numel() // 64) and max(n for _, n in recorded.reads) == 64
    assert [start for start, _ in recorded.reads] == sorted(start for start, _ in recorded.reads)
