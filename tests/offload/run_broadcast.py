"""Build a granular-offload engine on 2 gloo ranks while torch.distributed reports the NCCL backend, record every
tensor handed to a torch.distributed collective, and print one JSON line per ZeRO stage.

Usage (under torchrun, 2 ranks): run_broadcast.py STAGE [STAGE ...]. Each rank initializes TinyLM from its own seed,
so DeepSpeed's broadcast from rank 0 at initialize is what makes the replicas equal. Layers 0 and 2 are at
host_params: their parameters are host tensors, which NCCL refuses. On this CPU machine every tensor is a host
tensor, so what is checked is that no parameter's own storage reaches a collective (the broadcast goes through
staging buffers on the accelerator's device, at most ``ds_state.HOST_BROADCAST_CHUNK_BYTES`` each), and that the
replicas are equal afterwards.
"""
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real import ds_state  # noqa: E402
from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv")
CHUNK = 4096  # bytes: smaller than every host_params weight, so their broadcasts are split


def tensors_of(args, kwargs):
    found = []
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if torch.is_tensor(v))
    return found


class FakeNccl:
    """While active: torch.distributed.get_backend answers 'nccl', and every collective records the tensors it is
    handed (then runs on gloo as usual)."""

    def __init__(self):
        self.seen = []  # (collective, device type, storage address, bytes)
        self._saved = {}

    def __enter__(self):
        for name in COLLECTIVES + ("get_backend",):
            self._saved[name] = getattr(dist, name)
        dist.get_backend = lambda group=None: "nccl"
        for name in COLLECTIVES:
            setattr(dist, name, self._recording(name, self._saved[name]))
        return self

    def _recording(self, name, original):
        def collective(*args, **kwargs):
            for t in tensors_of(args, kwargs):
                self.seen.append((name, t.device.type, t.untyped_storage().data_ptr(), t.numel() * t.element_size()))
            return original(*args, **kwargs)
        return collective

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def run(stage, rank):
    torch.manual_seed(rank)
    model = TinyLM()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "granular_offload": {"levels": {"0": "host_params", "2": "host_params"}}}
    optimizer, patched, _ = build_offload_optimizer(model, config, "layers", dist.get_world_size())
    fetched = [p for g in optimizer.param_groups + optimizer.own_param_groups if g["level"] == "host_params"
               for p in g["params"]]
    host = {optimizer.host_params.host_tensor(p).untyped_storage().data_ptr() for p in fetched}  # one per layer
    params = {p.data.untyped_storage().data_ptr() for p in model.parameters()}
    ds_state.host_broadcast.HOST_BROADCAST_CHUNK_BYTES = CHUNK
    with FakeNccl() as fake:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
        attach_to_engine(engine)
    flat = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    x, y = batch(0, rank)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    optimizer.remove_hooks()
    ds_state.unroute_host_broadcasts()  # the next build_offload_optimizer puts the route back
    broadcasts = [s for s in fake.seen if s[0] == "broadcast"]
    return {"stage": stage, "rank": rank, "host_params": len(host),
            "param_storage_in_collective": sorted({s[0] for s in fake.seen if s[2] in params | host}),
            "broadcasts": len(broadcasts), "largest_broadcast": max((s[3] for s in broadcasts), default=0),
            "replicas_equal": all(torch.equal(everyone[0], other) for other in everyone[1:]),
            "loss": loss.item()}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for stage in sys.argv[1:]:
        sys.stdout.write("RESULT " + json.dumps(run(int(stage), rank)) + "\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
