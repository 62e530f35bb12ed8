"""Every collective the project issues itself takes tensors on the rank's GPU, as NCCL requires: the main job's
loss and evaluation sums, the delink's object gathers and barriers, the Megatron delink's reads of a
DistributedOptimizer's shards, and granular offload's own-gradient reduction and norm (rank 3 of 8, fake NCCL)."""
import os
import sys
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "offload"))
from tiny_model import TinyLM, batch, offload_config  # noqa: E402

import ds_pseudo_real  # noqa: E402
from ds_pseudo_real.ranks import barrier, gather  # noqa: E402
from launch.trainer import evaluate, sum_over_ranks  # noqa: E402
from megatron_patches.delink import _AdamState  # noqa: E402

CUDA3 = torch.device("cuda", 3)
WORLD = 8


class Engine:
    """What the main job reads of its engine to evaluate: a loss on the engine's device per batch."""

    device = CUDA3

    def __init__(self, losses):
        self.losses = iter(losses)

    def __call__(self, x, y):
        assert x.device == self.device and y.device == self.device
        return torch.tensor(next(self.losses), device=self.device)

    def eval(self):
        pass

    def train(self):
        pass


class Corpus:
    def batch(self, *args, **kwargs):
        return torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)


def allreduced_devices(nccl):
    return [devices for op, devices in nccl.calls if op == "c10d::allreduce_"]


def test_the_main_jobs_evaluation_and_training_sums_are_reduced_on_the_device(fake_nccl):
    torch.cuda.set_device(3)
    args = SimpleNamespace(eval_batches=2)
    # the fake backend's all_reduce leaves the sum as it is: the mean over 8 ranks of one rank's value
    assert evaluate(Engine([1.5, 2.5]), Corpus(), args, 2, 4, rank=3, world=WORLD) == 4.0 / (2 * WORLD)
    assert sum_over_ranks([torch.tensor(0.5, device=CUDA3), torch.tensor(1.0)], CUDA3) == [0.5, 1.0]
    assert allreduced_devices(fake_nccl) == [[CUDA3], [CUDA3]]


def test_the_megatron_delink_reads_a_distributed_optimizers_shards_on_the_device(fake_nccl):
    """_AdamState.read sums each rank's shard of the fp32 master and moments (and the step) over the data-parallel
    group. The DistributedOptimizer here is Megatron's class with the internals read set on it (megatron-core
    0.16.1): a shard on the GPU, torch Adam's step on the host."""
    torch.cuda.set_device(3)
    param = torch.nn.Parameter(torch.zeros(2, 3, device=CUDA3))
    shard = {"param": torch.arange(3.0, device=CUDA3), "exp_avg": torch.ones(3, device=CUDA3),
             "exp_avg_sq": torch.full((3,), 2.0, device=CUDA3), "step": torch.tensor(4.0)}
    inner = DistributedOptimizer.__new__(DistributedOptimizer)
    inner.model_param_group_index_map = {param: (0, 0)}
    inner.optimizer = SimpleNamespace(param_groups=[{"params": [shard["param"]]}])
    inner.data_parallel_group = None
    inner._get_main_param_and_optimizer_states = lambda p: dict(shard)
    inner._get_model_param_range_map = lambda p: {"param": SimpleNamespace(start=3, end=6)}
    read = _AdamState(inner).read(param)
    assert read["main"].tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 2.0]] and read["main"].device == CUDA3
    assert read["exp_avg_sq"].tolist() == [[0.0] * 3, [2.0] * 3] and read["step"].item() == 4.0
    assert not read["step_in_group"]
    assert allreduced_devices(fake_nccl) == [[CUDA3]] * 5


class SkipsLastLayer(TinyLM):
    """A step that does not run the last layer (its parameters get no gradient)."""

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers[:-1]:
            h = layer(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


class EngineReached(Exception):
    pass


def offload_optimizer_as_built(monkeypatch, stage, levels, model_class=TinyLM):
    """ds_pseudo_real.initialize up to deepspeed.initialize (see test_rank_device)."""
    reached = {}

    def initialize(**kwargs):
        reached.update(optimizer=kwargs["optimizer"])
        raise EngineReached

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    cfg = offload_config(stage, "host_params")
    cfg["granular_offload"]["levels"] = levels
    torch.manual_seed(0)
    model = model_class()
    with pytest.raises(EngineReached):
        ds_pseudo_real.initialize(model=model, config=cfg)
    return model, reached["optimizer"]


def test_the_delinks_object_gathers_and_barriers_use_the_ranks_gpu(fake_nccl, monkeypatch):
    """ds_pseudo_real.initialize makes the rank's device current, which NCCL's object collectives and barrier use
    (the delink and checkpoints gather results and fingerprints with them)."""
    offload_optimizer_as_built(monkeypatch, 2, {"0": "host_params", "1": "device", "2": "device", "3": "device"})
    assert gather({"rank": 3}) == [{"rank": 3}] * WORLD
    barrier()
    assert [op for op, _ in fake_nccl.calls] == ["c10d::allgather_", "c10d::allgather_", "c10d::barrier"]
    assert all(devices == [CUDA3] * len(devices) for _, devices in fake_nccl.calls)


def test_own_gradients_are_reduced_and_their_norm_taken_on_the_device(fake_nccl, monkeypatch):
    """ZeRO 2 keeps host_params layers outside DeepSpeed's optimizer: their gradients are all-reduced as the backward
    makes them, and the norm of expert gradients is all-reduced too (a group marked as experts here, its expert
    group the world)."""
    model, optimizer = offload_optimizer_as_built(monkeypatch, 2, {"0": "host_params", "1": "host_params",
                                                                   "2": "device", "3": "device"})
    own = optimizer.own_gradients
    own.groups[1]["moe"], own.groups[1]["name"] = True, "ep_size_1"
    monkeypatch.setattr(ds_pseudo_real.ds_state, "expert_data_parallel_group", lambda name: None)
    model.to(CUDA3)
    x, y = (t.to(CUDA3) for t in batch(0, 0))
    model(x, y).backward()
    norm = own.norm()
    reduced = allreduced_devices(fake_nccl)
    assert reduced == [[CUDA3]] * 3  # one flat all-reduce per layer, then the experts' norm
    # the fake all_reduce sums one rank: divided by 8 ranks; the expert square counted once over its 8 replicas
    dense = sum(own.host.grad_buffers[p].pow(2).sum() for p in own.groups[0]["params"])
    experts = sum(own.host.grad_buffers[p].pow(2).sum() for p in own.groups[1]["params"]) / WORLD
    assert norm.item() == pytest.approx((dense + experts).sqrt().item(), rel=1e-6) and norm.device.type == "cpu"
    optimizer.remove_hooks()


def test_zero0_reduces_a_device_gradient_for_a_host_params_layer_the_step_skipped():
    """fp32 ZeRO 0 all-reduces every parameter's gradient itself and makes a missing one as zeros on the parameter's
    device, which for a host_params parameter is the host: NCCL refuses it (and DeepSpeed's bucket would mix
    devices). What DeepSpeed (0.19.8 ``_get_gradients_for_reduction``) finds must already be a zero gradient on the
    store's device, as the fetched layers' gradients are."""
    from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer

    model = SkipsLastLayer()
    optimizer, patched, _ = build_offload_optimizer(model, offload_config(0, "host_params"), "layers", 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    store, found = optimizer.host_params, []
    reduce = engine._get_gradients_for_reduction

    def spy():
        found.append([(p.grad is None or p.grad.device, p.grad is not None and bool(p.grad.any()))
                      for p in model.layers[-1].parameters()])
        return reduce()

    engine._get_gradients_for_reduction = spy
    engine.backward(engine(*batch(0, 0)))
    engine.step()
    engine.destroy()
    optimizer.remove_hooks()
    assert found == [[(store.device, False)] * 6]


def test_the_zero_gradient_a_skipped_host_params_layer_gets_is_on_the_ranks_gpu(fake_gpu_rank, monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine, split_half_float_double_sparse
    from torch._utils import _flatten_dense_tensors

    model, optimizer = offload_optimizer_as_built(monkeypatch, 0, {"0": "device", "1": "device", "2": "device",
                                                                   "3": "host_params"}, SkipsLastLayer)
    model.to(CUDA3)
    x, y = (t.to(CUDA3) for t in batch(0, 0))
    model(x, y).backward()
    optimizer.host_params.give_missing_gradients()
    skipped = list(model.layers[3].parameters())
    assert all(p.device.type == "cpu" and p.grad.device == CUDA3 and not p.grad.any() for p in skipped)
    grads, _ = DeepSpeedEngine._get_gradients_for_reduction(SimpleNamespace(module=model, has_moe_layers=False))
    for _, bucket in split_half_float_double_sparse(grads)[1]:
        assert _flatten_dense_tensors(bucket).device == CUDA3  # DeepSpeed's flat all-reduce bucket


def test_megatron_stage_copies_are_synced_and_summed_on_the_device(fake_nccl, monkeypatch):
    """A pseudo block's set held on two pipeline stages (ranks 3 and 7 of a pipeline of 2 x 4 data-parallel
    ranks): ``connect`` gathers what every rank holds (an object collective, on the current device), makes the
    group of the set's holders and gives every copy the first one's values; ``reduce_gradients`` sums the copies'
    gradients over it. The fake group gives every rank this rank's report: the others' are what ranks 0-7 of that
    pipeline would report."""
    from megatron_patches import stage_copies
    from megatron_patches.stage_copies import Holding, StageCopies

    torch.cuda.set_device(3)
    gather = torch.distributed.all_gather_object

    def all_gather_object(reports, mine):
        gather(reports, mine)
        for rank in range(WORLD):
            pipeline = (rank % 4, rank % 4 + 4)
            reports[rank] = Holding(rank, pipeline, mine.groups if pipeline == mine.pipeline else frozenset())

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    layer = torch.nn.Linear(4, 4).to(CUDA3)
    chunk = torch.nn.Module()
    chunk.layer = layer
    chunk.stage_copies = StageCopies({0: (layer, 0)}, torch.distributed.new_group([3, 7]))
    weight = layer.weight.detach().clone()
    stage_copies.connect([chunk])
    assert torch.equal(layer.weight, weight) and list(chunk.stage_copies.process_groups) == [0]
    layer(torch.ones(2, 4, device=CUDA3)).sum().backward()
    grad = layer.weight.grad.clone()
    stage_copies.reduce_gradients([chunk])
    assert torch.equal(layer.weight.grad, grad)  # the fake sum over the two holders: this rank's own
    assert [op for op, _ in fake_nccl.calls] == ["c10d::allgather_"] * 2 + ["c10d::allreduce_"] * 2
