"""Memory contracts of the granular offload on a CUDA rank, checked under the fake CUDA rank (``fakes.py``): pinned
host buffers registered at their exact size (``torch.cuda.cudart()``) as the plan counts them and unregistered once
freed; a resume that puts the host levels' Adam state straight into its host buffers, never on the device; torch's
pinned cache emptied at the delink; and ``bias_correction`` false refused where torch's fused Adam steps."""
import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "offload"))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from gpu_contracts.fakes import FakeGpuRank  # noqa: E402
from tiny_model import TinyLM  # noqa: E402

from ds_pseudo_real import pinned  # noqa: E402
from ds_pseudo_real.offload import GranularOffloadOptimizer, PlacementLevel, model_groups  # noqa: E402
from ds_pseudo_real.offload.params import HostParamStore  # noqa: E402
from ds_pseudo_real.offload.planner import TrainingSetup, place  # noqa: E402

HOST_OPTIMIZER, DEVICE = PlacementLevel.HOST_OPTIMIZER.value, PlacementLevel.DEVICE.value


def test_a_pinned_buffer_is_registered_at_its_size_until_its_last_user_is_freed(fake_gpu_rank):
    cudart = fake_gpu_rank.cudart
    buffer = pinned.host_empty((3, 1001), torch.bfloat16, pin=True)
    assert cudart.calls == [("register", buffer.data_ptr(), 3 * 1001 * 2, 0)] and buffer.is_pinned()
    assert not buffer.any()  # fresh pages: zeros
    param = torch.nn.Parameter(torch.empty(1001, dtype=torch.bfloat16))
    param.data = buffer[1]  # a parameter's data, a view: the memory stays registered while they live
    view = buffer[2:]
    del buffer
    gc.collect()
    assert len(cudart.registered) == 1 and view.is_pinned()
    del view
    gc.collect()
    assert len(cudart.registered) == 1
    del param
    gc.collect()
    assert cudart.calls[1:] == [("unregister", cudart.calls[0][1])] and not cudart.registered
    unpinned = pinned.host_empty(7, torch.float32, pin=False)  # torch's CPU allocator: nothing registered
    assert len(cudart.calls) == 2 and not unpinned.is_pinned()


def test_the_offload_registers_one_buffer_per_group_and_kind_as_planned_and_frees_them(fake_gpu_rank):
    """fp32, ZeRO 0: layer 1 at host_optimizer (master, gradient buffer, two moments), layer 3 at host_params (its
    params, which are the master, gradient buffer, two moments). After a step, every pinned allocation is one of the
    plan's host buffers, at its size; the plan's host figure is what is registered."""
    cudart = fake_gpu_rank.cudart
    torch.manual_seed(0)
    model = TinyLM()
    sizes, params = model_groups(model, "layers")
    levels = {"layer1": PlacementLevel.HOST_OPTIMIZER, "layer3": PlacementLevel.HOST_PARAMS}
    store = HostParamStore(model, "layers", [list(model.layers[3].parameters())], pin_memory=True)
    groups = [{"params": ps, "placement": size.name, "level": levels.get(size.name, PlacementLevel.DEVICE).value}
              for size, ps in zip(sizes, params)]
    optimizer = GranularOffloadOptimizer(groups, host_params=store)
    for group in groups:  # the host groups' gradients, on the host as the layers are (no device step here)
        if group["level"] != DEVICE:
            for param in group["params"]:
                param.grad = torch.ones_like(param)
    optimizer.step()
    plan = place(sizes, levels, TrainingSetup("fp32", 0, 1, pinned_host=True))
    planned = sorted(size for placement in plan.placements for size in placement.host_buffers)
    assert sorted(size for _, _, size, _ in cudart.calls) == planned
    assert plan.host_bytes == sum(planned) == sum(cudart.registered.values())
    assert plan.host_allocated_bytes == sum(-(-size // 4096) * 4096 for size in planned)  # whole pages
    state = optimizer.state[model.layers[1].up.weight]
    assert all(state[key].is_pinned() for key in ("exp_avg", "exp_avg_sq"))
    assert store.host_tensor(model.layers[3].up.weight).is_pinned()
    store.remove()
    del optimizer, store, model, state, groups, params, param
    gc.collect()
    assert not cudart.registered and len(cudart.calls) == 2 * len(planned)


def test_a_resume_never_makes_host_level_state_on_the_parameters_device(fake_gpu_rank):
    """torch's ``Optimizer.load_state_dict`` moves every saved state to its parameter's device: the state of a
    host_optimizer group must go straight into its host buffers instead (all of it on the device at once would be
    what the plan moved off it); a device group's state goes to the device, where torch's fused Adam steps it."""
    def optimizer():
        host = [torch.nn.Parameter(torch.zeros(3, 2, device="cuda:3")) for _ in range(2)]
        device = [torch.nn.Parameter(torch.zeros(4, device="cuda:3"))]
        return GranularOffloadOptimizer([{"params": host, "placement": "layer0", "level": HOST_OPTIMIZER},
                                         {"params": device, "placement": "other", "level": DEVICE}]), host

    # a checkpoint as DeepSpeed loads it: every state on the CPU (keyed by the params' positions), host ones with an
    # int step, each host parameter's moments its own
    state = {index: {"step": 7, "exp_avg": torch.full((3, 2), index + 1.0), "exp_avg_sq": torch.full((3, 2), 0.5)}
             for index in range(2)}
    state[2] = {"step": torch.tensor(7.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
    saved = {**optimizer()[0].state_dict(), "state": state}
    opt, host = optimizer()
    before = len(fake_gpu_rank.allocations)
    opt.load_state_dict(saved)
    made = [(a.device, a.shape) for a in fake_gpu_rank.allocations[before:]]
    assert (fake_gpu_rank.device, (3, 2)) not in made, "host_optimizer state made on the parameters' device"
    assert (fake_gpu_rank.device, (4,)) in made
    for index, p in enumerate(host):
        assert opt.state[p]["step"] == 7
        for key, value in (("exp_avg", index + 1.0), ("exp_avg_sq", 0.5)):
            moment = opt.state[p][key]
            assert moment.device == torch.device("cpu") and torch.equal(moment, torch.full((3, 2), value))
            assert moment.data_ptr() == opt.host.buffer(p, key).data_ptr() and moment.is_pinned()
    assert saved["state"][0]["exp_avg"].device == torch.device("cpu")  # the caller's checkpoint is left as it was


def test_bias_correction_off_is_refused_where_torchs_fused_adam_steps_device_groups():
    """On CUDA the groups at 'device' step with torch's fused Adam, which always corrects the bias: without bias
    correction they would step differently from the host levels (DeepSpeed's CPU kernel honours the key), so the
    optimizer refuses it, naming the key. On the CPU every level steps with DeepSpeed's kernel: accepted there."""
    def groups(device):
        return [{"params": [torch.nn.Parameter(torch.zeros(2, device=device))], "placement": "layer0",
                 "level": DEVICE},
                {"params": [torch.nn.Parameter(torch.zeros(2, device=device))], "placement": "layer1",
                 "level": HOST_OPTIMIZER}]

    GranularOffloadOptimizer(groups("cpu"), bias_correction=False)  # a CPU run
    with FakeGpuRank():
        GranularOffloadOptimizer(groups("cuda:3")[1:], bias_correction=False)  # no device group: accepted
        with pytest.raises(ValueError) as refused:
            GranularOffloadOptimizer(groups("cuda:3"), bias_correction=False)
    assert str(refused.value).startswith(
        "optimizer.params.bias_correction: got False, but granular_offload steps the groups at 'device' on CUDA "
        "with torch's fused Adam, which always corrects the bias (groups: ['layer0']); accepted: true")


def test_the_delink_empties_torchs_pinned_cache(monkeypatch):
    """torch's caching host allocator keeps freed pinned blocks (DeepSpeed's, a non_blocking copy to the host) for the
    process: emptied once the pseudo engine is released (``torch._C._host_emptyCache``, CUDA builds only; on this
    CPU run a recorder stands in for it)."""
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
