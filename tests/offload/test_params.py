"""HostParamStore on a plain torch model: parameters live on the host between uses, the forward and backward see
fetched copies, gradients are bit-identical to a model without the store, and fetches/buffers are as planned."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.offload.params import HostParamStore
from ds_pseudo_real.sharing import apply_sharing

LAYER_BYTES = 8416 * 4


def grads(model):
    loss = model(*batch(0, 0))
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_layers_run_on_fetched_copies_and_gradients_match():
    torch.manual_seed(0)
    plain = TinyLM()
    torch.manual_seed(0)
    model = TinyLM()
    store = HostParamStore(model, "layers", [list(model.layers[1].parameters()), list(model.layers[3].parameters())])
    weight = model.layers[1].up.weight
    seen = []
    model.layers[1].up.register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    assert weight.data_ptr() == store.host_tensor(weight).data_ptr()
    assert [torch.equal(a, b) for a, b in zip(grads(plain), grads(model))] == [True] * len(list(plain.parameters()))
    assert seen[0] != store.host_tensor(weight).data_ptr()  # the forward ran on a fetched copy
    assert weight.data_ptr() == store.host_tensor(weight).data_ptr()  # released afterwards
    # layers 1 and 3: fetched for the forward and again for the backward; at most the running and the next layer
    assert store.fetched_bytes == 2 * 2 * LAYER_BYTES
    assert store.peak_buffered_bytes == 2 * LAYER_BYTES and store.buffered_bytes == 0


def test_without_prefetch_one_layer_is_buffered():
    model = TinyLM()
    store = HostParamStore(model, "layers", [list(model.layers[i].parameters()) for i in range(4)], prefetch=False)
    grads(model)
    assert store.peak_buffered_bytes == LAYER_BYTES and store.fetched_bytes == 2 * 4 * LAYER_BYTES


def test_pseudo_model_fetches_the_shared_set_per_layer():
    torch.manual_seed(0)
    plain = apply_sharing(TinyLM(), "layers", 1)
    torch.manual_seed(0)
    model = apply_sharing(TinyLM(), "layers", 1)
    store = HostParamStore(model, "layers", [list(model.layers[0].parameters())])
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model)))
    assert store.fetched_bytes == 2 * 4 * LAYER_BYTES
    assert store.peak_buffered_bytes == 2 * LAYER_BYTES
    store.remove()
    before = store.fetched_bytes
    grads(model)
    assert store.fetched_bytes == before  # hooks are off


def test_model_conversions_leave_host_params_on_the_host():
    """A dtype cast of the whole model (as the engine's bf16 cast and .to(device) go through Module._apply)
    converts the host params one by one and keeps them in the store: the host copy is the converted param."""
    torch.manual_seed(0)
    model = TinyLM()
    expected = model.layers[2].up.weight.detach().to(torch.bfloat16)
    store = HostParamStore(model, "layers", [list(model.layers[2].parameters())])
    weight = model.layers[2].up.weight
    model.to(torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and store.host_tensor(weight).dtype == torch.bfloat16
    assert weight.data_ptr() == store.host_tensor(weight).data_ptr() and torch.equal(weight.detach(), expected)
    assert model.layers[1].up.weight.dtype == torch.bfloat16  # layers without host params convert as usual
    model.to("cpu")
    assert weight.data_ptr() == store.host_tensor(weight).data_ptr()
    store.remove()
    assert "_apply" not in model.layers[2].__dict__
