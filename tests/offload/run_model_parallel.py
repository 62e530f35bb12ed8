"""Train on 2 ranks under model parallelism with and without granular offload and print one JSON line per case: both
runs' losses and weights (which must be equal), and this rank's plan against what the offload optimizer holds.

Usage (under torchrun, 2 ranks): run_model_parallel.py CASE [CASE ...]
  tp:STAGE       TinyLM with Megatron-style 2-way tensor-parallel blocks (column-parallel up, row-parallel down),
                 through ``ds_pseudo_real.initialize(..., mpu=...)``: both ranks are one data-parallel rank. Layers
                 1 and 3 at host_params, 2 at host_optimizer. No gradient clipping: the steps are bit for bit.
  tp-clip:STAGE  the same with gradient clipping at a norm every step exceeds: the clip coefficient is the whole
                 model's norm, both slices and the replicated parameters counted once, as DeepSpeed counts them.
  pp:STAGE       a DeepSpeed PipelineModule of 6 layers (embedding, 4 blocks, head) on 2 stages, 2 micro-batches
                 per step, built with ``build_offload_optimizer`` and ``deepspeed.initialize``: layer 1 at
                 host_optimizer, 2 and 3 at host_params, 4 at host_optimizer (each stage holds some of them).
"""
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import Block, TinyLM, batch  # noqa: E402

import ds_pseudo_real  # noqa: E402
from ds_pseudo_real.ds_state import basic_optimizer  # noqa: E402
from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402

ADAM = {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}
STEPS = 3
MICRO_BATCHES = 2  # pipeline cases: micro-batches per step
CLIP = 0.05  # below every step's gradient norm in tp-clip
LEVELS = {"tp": {"1": "host_params", "2": "host_optimizer", "3": "host_params"},
          "pp": {"1": "host_optimizer", "2": "host_params", "3": "host_params", "4": "host_optimizer"}}


class TensorParallel:
    """Megatron-style mpu: every rank in one tensor-parallel group, each its own data-parallel group."""

    def __init__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        self.data_group, self.tensor_group = singles[rank], dist.new_group(list(range(world)))

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group_ranks(self):
        return [dist.get_rank()]

    def get_tensor_model_parallel_group(self):
        return self.tensor_group

    def get_tensor_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank()

    def get_pipeline_model_parallel_world_size(self):
        return 1

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank


class _ToTensorParallel(torch.autograd.Function):
    """Megatron's copy to the tensor-parallel region: identity forward, input gradients summed over the slices."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromTensorParallel(torch.autograd.Function):
    """Megatron's reduce from the tensor-parallel region: the slices' partial outputs summed, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _split(param, rows, dim):
    sliced = nn.Parameter(param.detach().narrow(dim, rows.start, len(rows)).clone())
    sliced.tensor_model_parallel = True  # what DeepSpeed's norm reads (runtime.utils.is_model_parallel_parameter)
    return sliced


class TensorParallelBlock(nn.Module):
    """tiny_model.Block split over the tensor-parallel ranks: this rank's slice of the hidden units; the norm and
    the output bias replicated."""

    def __init__(self, full: Block, rank: int, size: int, group):
        super().__init__()
        hidden = full.up.out_features // size
        rows = range(rank * hidden, (rank + 1) * hidden)
        self.group = group
        self.norm = full.norm
        self.up_weight, self.up_bias = _split(full.up.weight, rows, 0), _split(full.up.bias, rows, 0)
        self.down_weight, self.down_bias = _split(full.down.weight, rows, 1), full.down.bias

    def forward(self, x):
        h = _ToTensorParallel.apply(self.norm(x), self.group)
        h = torch.relu(nn.functional.linear(h, self.up_weight, self.up_bias))
        return x + _FromTensorParallel.apply(nn.functional.linear(h, self.down_weight), self.group) + self.down_bias


def tensor_parallel_model(mpu):
    torch.manual_seed(0)
    model = TinyLM()
    rank, size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    model.layers = nn.ModuleList(TensorParallelBlock(b, rank, size, mpu.tensor_group) for b in model.layers)
    return model


class Embedding(nn.Embedding):
    def forward(self, x):
        return super().forward(x)


def pipeline_model():
    specs = [LayerSpec(Embedding, 64, 32), *[LayerSpec(Block, 32) for _ in range(4)], LayerSpec(nn.Linear, 32, 64)]
    return PipelineModule(specs, num_stages=2, partition_method="uniform", seed_layers=True, base_seed=0,
                          loss_fn=lambda logits, y: nn.functional.cross_entropy(logits.view(-1, 64), y.view(-1)))


def config(stage, clip, micro_batches=1):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": micro_batches,
            "steps_per_print": 10**6, "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": ADAM}}


def train_tensor_parallel(engine):
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, 0)  # one data-parallel rank: both slices see the same batch
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    return losses, norms


def train_pipeline(engine):
    losses, norms = [], []
    for step in range(STEPS):
        data = iter([batch(step * MICRO_BATCHES + m, 0) for m in range(MICRO_BATCHES)])
        losses.append(engine.train_batch(data).item())
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    return losses, norms


def params_of(engine):
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])


def plan_report(plan, optimizer, model, layers):
    """This rank's plan (group -> numel, level, planned host bytes) beside the bytes the optimizer holds and the
    parameters this rank has in each of its layers (``layers``: name -> module) and outside them (``other``)."""
    held = optimizer.held_bytes_by_group()
    local = {name: sum(p.numel() for p in layer.parameters()) for name, layer in layers.items()}
    local["other"] = sum(p.numel() for p in model.parameters()) - sum(local.values())
    return {p.group.name: {"numel": p.group.numel, "level": p.level.value, "planned_host": p.bytes.host,
                           "held_host": held[p.group.name]["host"], "local_numel": local[p.group.name]}
            for p in plan.placements}


def run_tensor_parallel(case, stage, mpu):
    clip = CLIP if case == "tp-clip" else 0.0
    ref, *_ = deepspeed.initialize(model=tensor_parallel_model(mpu), mpu=mpu, config=config(stage, clip))
    ref_losses, ref_norms = train_tensor_parallel(ref)
    ref_params = params_of(ref)
    ref.destroy()
    model = tensor_parallel_model(mpu)
    engine, *_ = ds_pseudo_real.initialize(model=model, mpu=mpu, config={
        **config(stage, clip), "granular_offload": {"levels": LEVELS["tp"]}})
    optimizer = basic_optimizer(engine.engine)
    losses, norms = train_tensor_parallel(engine)
    layers = {f"layer{i}": layer for i, layer in enumerate(model.layers)}
    report = plan_report(engine.offload_plan, optimizer, model, layers)  # host buffers are made at the first step
    return ref_losses, ref_norms, ref_params, losses, norms, params_of(engine), report


def run_pipeline(stage):
    ref, *_ = deepspeed.initialize(model=pipeline_model(), config=config(stage, 0.0, MICRO_BATCHES))
    ref_losses, ref_norms = train_pipeline(ref)
    ref_params = params_of(ref)
    ref.destroy()
    model = pipeline_model()
    full = {**config(stage, 0.0, MICRO_BATCHES), "granular_offload": {"levels": LEVELS["pp"]}}
    data_parallel = model.mpu().get_data_parallel_world_size()
    optimizer, patched, plan = build_offload_optimizer(model, full, "layers", data_parallel)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    losses, norms = train_pipeline(engine)
    layers = {f"layer{name}": layer for name, layer in model.named_children() if name.isdigit()}
    report = plan_report(plan, optimizer, model, layers)
    params = params_of(engine)
    optimizer.remove_hooks()
    engine.destroy()
    return ref_losses, ref_norms, ref_params, losses, norms, params, report


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank, mpu = dist.get_rank(), None
    for case in sys.argv[1:]:
        kind, stage = case.split(":")
        if kind.startswith("tp"):
            mpu = mpu or TensorParallel()
            ref_losses, ref_norms, ref_params, losses, norms, params, report = run_tensor_parallel(kind, int(stage),
                                                                                                  mpu)
        else:
            ref_losses, ref_norms, ref_params, losses, norms, params, report = run_pipeline(int(stage))
        result = {"case": case, "rank": rank, "ref_losses": ref_losses, "losses": losses, "ref_norms": ref_norms,
                  "norms": norms, "params_max_diff": float((ref_params - params).abs().max()), "plan": report}
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
