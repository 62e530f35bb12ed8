"""A resume puts the host levels' Adam state straight back into their host buffers: torch's
``Optimizer.load_state_dict`` casts every state to its parameter's device first, which for a plan that moved the
state off the device would land all of it there at once (an OOM on a tight plan) before it is moved back. Checked
with the parameters on another device than the CPU (``meta`` stands in for CUDA here): every tensor made during the
load is recorded, and none of a host group's state may be on the parameters' device."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ds_pseudo_real.offload import GranularOffloadOptimizer, PlacementLevel

DEVICE = torch.device("meta")


class MadeOn(TorchDispatchMode):
    """Records the device and shape of every tensor an operation makes while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(t.device, tuple(t.shape)) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def optimizer():
    """A host_optimizer group of two (3, 2) parameters and a device group of a (4,) one, all on DEVICE."""
    host = [torch.nn.Parameter(torch.zeros(3, 2, device=DEVICE)) for _ in range(2)]
    device = [torch.nn.Parameter(torch.zeros(4, device=DEVICE))]
    return GranularOffloadOptimizer([
        {"params": host, "placement": "layer0", "level": PlacementLevel.HOST_OPTIMIZER.value},
        {"params": device, "placement": "other", "level": PlacementLevel.DEVICE.value}]), host, device


def checkpoint():
    """What a checkpoint of that plan holds, as DeepSpeed loads it: every state on the CPU (states are keyed by the
    params' positions, the host group's first), host ones with an int step, each host parameter's moments its own."""
    state = {index: {"step": 7, "exp_avg": torch.full((3, 2), index + 1.0), "exp_avg_sq": torch.full((3, 2), 0.5)}
             for index in range(2)}
    state[2] = {"step": torch.tensor(7.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
    return {**optimizer()[0].state_dict(), "state": state}


def test_a_resume_never_makes_host_level_state_on_the_parameters_device(monkeypatch):
    # the device group is stepped on DEVICE as torch's fused Adam steps it on CUDA
    monkeypatch.setattr(GranularOffloadOptimizer, "_steps_on_device",
                        staticmethod(lambda p, level: level == PlacementLevel.DEVICE.value and p.device == DEVICE))
    opt, host, _ = optimizer()
    saved = checkpoint()
    recorder = MadeOn()
    with recorder:
        opt.load_state_dict(saved)
    on_device = [shape for where, shape in recorder.made if where == DEVICE]
    assert (3, 2) not in on_device, "host_optimizer state made on the parameters' device"
    assert (4,) in on_device  # the device group's state goes where torch's fused Adam steps it on CUDA
    for index, p in enumerate(host):
        state = opt.state[p]
        assert state["step"] == 7
        for key, value in (("exp_avg", index + 1.0), ("exp_avg_sq", 0.5)):
            assert state[key].device == torch.device("cpu") and torch.equal(state[key], torch.full((3, 2), value))
            assert state[key].data_ptr() == opt.host.buffer(p, key).data_ptr()  # in the group's flat buffer
    assert saved["state"][0]["exp_avg"].device == torch.device("cpu")  # the caller's checkpoint is left as it was
