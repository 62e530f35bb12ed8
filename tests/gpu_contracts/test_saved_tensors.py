"""Saved-tensor accounting: autograd saves views of a fetched host_params weight for the backward (``F.linear``
saves ``weight.t()``), so dropping the store's reference frees nothing: every layer's fetched copy would stay on the
device until the backward. The store frees the copy's storage in place after the forward (the saved views go with
it) and refills the same storage before the backward, so the device holds what the plan counts: two layers."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "offload"))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.offload.params import HostParamStore  # noqa: E402
from ds_pseudo_real.sharing import apply_sharing  # noqa: E402

LAYER_BYTES = 8416 * 4


def is_copy(t: torch.Tensor, hosts) -> bool:
    """Whether ``t`` is a view of a fetched copy of one of the host params ``hosts`` (its storage holds exactly
    that param's values), not of a host tensor or an activation; a freed copy holds nothing."""
    storage = t.untyped_storage()
    return any(storage.nbytes() == h.numel() * h.element_size()
               and storage.data_ptr() != h.untyped_storage().data_ptr()
               and torch.equal(torch.empty(0, dtype=h.dtype).set_(storage, 0, h.shape), h) for h in hosts)


def saved_copy_bytes(saved, hosts) -> int:
    """Bytes of the live storages of fetched copies that the saved tensors keep."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved if is_copy(t, hosts)}
    return sum(storages.values())


def run(model, layers):
    """Forward and backward with ``layers`` at host_params; returns the bytes of fetched copies the saved tensors
    keep after the forward, (saved tensors', store's) bytes at every layer's hooks, the gradients and the store."""
    store = HostParamStore(model, "layers", [list(model.layers[i].parameters()) for i in layers])
    hosts = [store.host_tensor(p) for i in layers for p in model.layers[i].parameters()]
    saved, samples = [], []

    def sample(*_):
        samples.append((saved_copy_bytes(saved, hosts), store.buffered_bytes))

    for layer in model.layers:  # after the store's hooks: the layer's copies fetched, or released
        for register in (layer.register_forward_pre_hook, layer.register_forward_hook,
                         layer.register_full_backward_pre_hook, layer.register_full_backward_hook):
            register(sample)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(*batch(0, 0))
    after_forward = saved_copy_bytes(saved, hosts)
    loss.backward()
    return after_forward, samples, [p.grad for p in model.parameters()], store


def test_after_the_forward_no_fetched_layer_stays_on_the_device():
    torch.manual_seed(0)
    plain = TinyLM()
    plain(*batch(0, 0)).backward()
    torch.manual_seed(0)
    after_forward, samples, grads, store = run(TinyLM(), range(4))
    assert after_forward == 0 and store.buffered_bytes == 0
    assert all(kept <= held for kept, held in samples)  # no copy outlives its release through a saved view
    assert max(held for _, held in samples) == 2 * LAYER_BYTES  # the layer running and the one prefetched, planned
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, plain.parameters()))  # bit for bit


def test_a_pseudo_models_shared_set_is_held_twice_at_most():
    torch.manual_seed(0)
    plain = apply_sharing(TinyLM(), "layers", 1)
    plain(*batch(0, 0)).backward()
    torch.manual_seed(0)
    after_forward, samples, grads, _ = run(apply_sharing(TinyLM(), "layers", 1), [0, 1, 2, 3])
    assert after_forward == 0 and all(kept <= held for kept, held in samples)
    assert max(held for _, held in samples) == 2 * LAYER_BYTES
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, plain.parameters()))
