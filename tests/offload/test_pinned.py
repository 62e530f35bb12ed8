"""Pinned host memory of the offload, checked on the CPU with CUDA faked (``torch.cuda.cudart()`` records the
registrations): every pinned buffer is registered at its exact size, one flat buffer per group and kind as the plan
counts them, and unregistered once the last tensor using it is freed; the delink empties torch's pinned cache."""
import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tiny_model import TinyLM  # noqa: E402

from ds_pseudo_real.offload import GranularOffloadOptimizer, model_groups  # noqa: E402
from ds_pseudo_real.offload import pinned  # noqa: E402
from ds_pseudo_real.offload.params import HostParamStore  # noqa: E402
from ds_pseudo_real.offload.planner import PlacementLevel, TrainingSetup, place  # noqa: E402


class FakeCudart:
    """The two calls of the CUDA runtime that pin host memory, recorded; every registration succeeds."""

    def __init__(self):
        self.registered, self.unregistered, self.live = [], [], {}

    def cudaHostRegister(self, address, size, flags):
        assert address not in self.live and flags == 0
        self.registered.append((address, size))
        self.live[address] = size
        return 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        del self.live[address]
        return 0


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def cuda_host(monkeypatch):
    """A CUDA process as far as the offload's host side sees it (no device copy is made in these tests)."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_a_pinned_buffer_is_registered_at_its_size_until_its_last_user_is_freed(cuda_host):
    buffer = pinned.host_empty((3, 1001), torch.bfloat16, pin=True)
    assert cuda_host.registered == [(buffer.data_ptr(), 3 * 1001 * 2)] and pinned.is_pinned(buffer)
    assert not buffer.any()  # fresh pages: zeros
    param = torch.nn.Parameter(torch.empty(1001, dtype=torch.bfloat16))
    param.data = buffer[1]  # a parameter's data, a view: the memory stays registered while they live
    view = buffer[2:]
    del buffer
    gc.collect()
    assert cuda_host.unregistered == [] and pinned.is_pinned(view)
    del view
    gc.collect()
    assert cuda_host.unregistered == []
    del param
    gc.collect()
    assert cuda_host.unregistered == [address for address, _ in cuda_host.registered] and not cuda_host.live
    assert pinned.registered_bytes() == 0
    unpinned = pinned.host_empty(7, torch.float32, pin=False)  # torch's CPU allocator: nothing registered
    assert len(cuda_host.registered) == 1 and not pinned.is_pinned(unpinned)


def test_the_offload_registers_one_buffer_per_group_and_kind_as_planned_and_frees_them(cuda_host):
    """fp32, ZeRO 0: layer 1 at host_optimizer (master, gradient buffer, two moments), layer 3 at host_params (its
    params, which are the master, gradient buffer, two moments). After a step, every pinned allocation is one of the
    plan's host buffers, at its size; the plan's host figure is what is registered."""
    torch.manual_seed(0)
    model = TinyLM()
    sizes, params = model_groups(model, "layers")
    levels = {"layer1": PlacementLevel.HOST_OPTIMIZER, "layer3": PlacementLevel.HOST_PARAMS}
    store = HostParamStore(model, "layers", [list(model.layers[3].parameters())], pin_memory=True)
    groups = [{"params": ps, "placement": size.name, "level": levels.get(size.name, PlacementLevel.DEVICE).value}
              for size, ps in zip(sizes, params)]
    optimizer = GranularOffloadOptimizer(groups, host_params=store)
    for group in groups:  # the device groups' params would be on the device: not stepped here
        if group["level"] != PlacementLevel.DEVICE.value:
            for param in group["params"]:
                param.grad = torch.ones_like(param)
    optimizer.step()
    plan = place(sizes, levels, TrainingSetup("fp32", 0, 1, pinned_host=True))
    planned = sorted(size for placement in plan.placements for size in placement.host_buffers)
    assert sorted(size for _, size in cuda_host.registered) == planned
    assert plan.host_bytes == sum(planned) == pinned.registered_bytes()
    assert plan.host_allocated_bytes == sum(-(-size // 4096) * 4096 for size in planned)  # whole pages
    state = optimizer.state[model.layers[1].up.weight]
    assert all(pinned.is_pinned(state[key]) for key in ("exp_avg", "exp_avg_sq"))
    assert pinned.is_pinned(store.host_tensor(model.layers[3].up.weight))
    store.remove()
    del optimizer, store, model, state, groups, params, param
    gc.collect()
    assert not cuda_host.live and sorted(cuda_host.unregistered) == sorted(a for a, _ in cuda_host.registered)


def test_the_delink_empties_torchs_pinned_cache(monkeypatch):
    """torch's caching host allocator keeps freed pinned blocks (DeepSpeed's, a non_blocking copy to the host) for the
    process: emptied once the pseudo engine is released (``torch._C._host_emptyCache``, CUDA builds only)."""
    import ds_pseudo_real
    from delink_matrix import config, fixed_batch, tiny_gpt

    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True), raising=False)
    engine, *_ = ds_pseudo_real.initialize(model=tiny_gpt(), config=config(1, "fp32", "reset", switch=2))
    for step in range(2):
        engine.backward(engine(*fixed_batch(step)))
        engine.step()
        assert len(emptied) == step, "emptied once, at the delink"
    assert engine.stage == "real"
    engine.engine.destroy()
