"""The delink under ZeRO-3 with the optimizer state swapped to NVMe (``offload_optimizer: nvme``), beside the same
run with it offloaded to host memory (``cpu``: the same CPU Adam on the same state): losses, the carried moments and
how often each optimizer sub-group was swapped in and out during the delink. Imported by tests/test_nvme_offload.py;
run under torchrun for 2 ranks (``--out DIR``: each rank writes its results to DIR/rank<N>.json)."""
import json
import os
import sys
from unittest import mock

import torch
from torch import nn

import ds_pseudo_real
from ds_pseudo_real import ds_state
from ds_pseudo_real.models import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from delink_matrix import config, fixed_batch, nan_filled  # noqa: E402

SUB_GROUP = 400_000  # elements of a rank's partition per sub-group; DeepSpeed swaps one of 1 MiB or more


def width(world: int) -> int:
    """d_model for ``world`` ranks: each rank's partition of one layer (12 x d_model^2) is over 1 MiB, so the pseudo
    model's sub-group is swapped, and the real model makes at least 3 swapped sub-groups."""
    return 160 if world == 1 else 224


def gpt_with_idle_parameters(d_model: int) -> nn.Module:
    """4 layers, a parameter per layer in no forward (no gradient, no moments to carry: zeroed), and an odd total."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, d_model=d_model, n_head=2, seq_len=16))
    for layer in model.layers:
        layer.register_parameter("idle", nn.Parameter(torch.zeros(7)))
    model.register_parameter("idle", nn.Parameter(torch.zeros(3)))
    return model


def offload_config(device: str, swap_dir: str, policy: str = "copy", dtype: str = "fp32") -> dict:
    cfg = config(3, dtype, policy, switch=2)
    cfg["optimizer"]["params"].pop("torch_adam")
    offload = {"device": device}
    if device == "nvme":
        offload["nvme_path"] = swap_dir
    cfg["zero_optimization"].update({"offload_optimizer": offload, "sub_group_size": SUB_GROUP})
    return cfg


def swappable_sub_groups(engine) -> int:
    return len(ds_state.swapped_sub_groups(engine.engine))


class Recorder(ds_pseudo_real.TrainingCallback):
    """The pseudo engine's full moments and swapped sub-groups just before the delink, and the swaps counted then."""

    def __init__(self, swaps):
        self.engine, self.pseudo, self.swapped, self.swaps, self.swaps_at_delink = None, {}, None, swaps, None

    def on_step_end(self, state, control):
        if control.should_delink:
            self.pseudo = {n: ds_state.full_moments(self.engine.engine, p, n)
                           for n, p in self.engine.module.named_parameters() if not n.endswith("idle")}
            self.swapped = swappable_sub_groups(self.engine)
            self.swaps_at_delink = dict(self.swaps)


def train(cfg: dict, d_model: int, steps: int = 4):
    """Losses of ``steps`` steps (the delink after the second), the engine, the recorder and the swaps of an
    optimizer sub-group in and out during the delink. The moments the delink allocates are NaN until written."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    swaps = {"in": 0, "out": 0}
    counters = []
    for way, method in (("in", "_optimizer_states_and_gradient_swap_in"),
                        ("out", "_optimizer_states_and_gradient_swap_out")):
        original = getattr(Stage3, method)

        def counted(self, sub_group_id, timer_names=None, _way=way, _original=original):
            swaps[_way] += 1
            return _original(self, sub_group_id, timer_names)

        counters.append(mock.patch.object(Stage3, method, counted))
    recorder = Recorder(swaps)
    with mock.patch.object(ds_state.moments, "unfilled", nan_filled), counters[0], counters[1]:
        engine, *_ = ds_pseudo_real.initialize(model=gpt_with_idle_parameters(d_model), config=cfg,
                                               callbacks=[recorder])
        recorder.engine = engine
        rank = torch.distributed.get_rank()
        losses, during = [], {}
        for step in range(steps):
            loss = engine(*fixed_batch(step + 10 * rank))
            engine.backward(loss)
            engine.step()
            if step == 1:
                assert engine.stage == "real"
                during = {k: swaps[k] - recorder.swaps_at_delink[k] for k in swaps}
            losses.append(loss.item())
    return losses, engine, recorder, during


def source_of(name: str) -> str:
    return "layers.0." + name.split(".", 2)[2] if name.startswith("layers.") else name


def carried_moments_check(engine, pseudo) -> list:
    """Names of the real parameters whose moments, right after the delink, are not their source's (the idle ones:
    not zero), or hold an unwritten (NaN) element."""
    bad = []
    for name, param in engine.module.named_parameters():
        moments = ds_state.full_moments(engine.engine, param, name)
        if any(m.isnan().any() for m in moments.values()):
            bad.append(name)
        elif name.endswith("idle"):
            if not all(torch.equal(m, torch.zeros(param.ds_shape)) for m in moments.values()):
                bad.append(name)
        elif not all(torch.equal(moments[k], pseudo[source_of(name)][k]) for k in ds_state.MOMENT_KEYS):
            bad.append(name)
    return bad


def two_rank_case(swap_dir: str, dtype: str) -> dict:
    """On this rank: the nvme run's losses against the cpu run's, the moments right after the delink, the swaps."""
    world = torch.distributed.get_world_size()
    host_losses, host, *_ = train(offload_config("cpu", swap_dir, dtype=dtype), width(world))
    host.engine.destroy()
    _, engine, recorder, during = train(offload_config("nvme", swap_dir, dtype=dtype), width(world), steps=2)
    bad = carried_moments_check(engine, recorder.pseudo)
    real_swapped = swappable_sub_groups(engine)
    engine.engine.destroy()
    losses, engine, *_ = train(offload_config("nvme", swap_dir, dtype=dtype), width(world))
    engine.engine.destroy()
    return {"rank": torch.distributed.get_rank(), "dtype": dtype, "losses": losses, "host_losses": host_losses,
            "moments_not_carried": bad, "pseudo_swapped": recorder.swapped, "real_swapped": real_swapped,
            "swaps_during_delink": during}


if __name__ == "__main__":
    import deepspeed

    deepspeed.init_distributed()
    out = sys.argv[sys.argv.index("--out") + 1]
    results = [two_rank_case(os.path.join(out, f"swap_{dtype}"), dtype) for dtype in ("fp32", "bf16")]
    with open(os.path.join(out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
