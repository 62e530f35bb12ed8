"""Train on 2 ranks with and without granular offload and print one JSON line per case: the losses and the
weights of both runs, which must be equal.

Usage (under torchrun, 2 ranks): run_groups.py CASE [CASE ...], m6 cases first (DeepSpeed keeps the mpu of the
first engine given one in a global, and its MoE layers would then gather tokens over the model-parallel ranks).
  dp1:STAGE  TinyLM, layers 0 and 2 at host_params, under an mpu declaring a data-parallel group of one rank per
             rank (each rank trains its own replica on its own batches, as each data-parallel slice of a 2-way
             model-parallel run would). Adam's eps is large so that a gradient averaged over the wrong number of
             ranks shows.
  m6:STAGE   a 3-layer M6 (DeepSpeed MoE, expert prototyping) with ep_size 2: each rank holds 2 of the 4 experts
             of a layer, its expert-data-parallel group being itself; layer 1 and the experts of layers 1 and 2 at
             host_params (layer 0's stay in DeepSpeed's optimizer, which needs an MoE group).
"""
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.models.m6 import M6GPT  # noqa: E402
from ds_pseudo_real.moe.architecture import M6Architecture  # noqa: E402
from ds_pseudo_real.offload import (  # noqa: E402
    PlacementLevel, attach_to_engine, build_offload_optimizer, model_groups, param_group,
)

ADAM = {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-3}
STEPS = 3
M6_SMALL = M6Architecture("m6-test", num_layers=3, hidden_size=32, num_heads=4, expert_ffn_size=64, num_experts=4,
                          num_prototypes=2, vocab_size=64, seq_length=8)
LEVELS = {"dp1": {"0": "host_params", "2": "host_params"},
          "m6": {"1": "host_params", "1.experts": "host_params", "2.experts": "host_params"}}


class OneRankDataParallel:
    """Megatron-style mpu (the deprecated names DeepSpeed 0.19.8 still reads): data parallel = this rank alone,
    model parallel = every rank."""

    def __init__(self):
        rank = dist.get_rank()
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
        self.data_group, self.model_group = singles[rank], dist.new_group(list(range(dist.get_world_size())))

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group_ranks(self):
        return [dist.get_rank()]

    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_model_parallel_rank(self):
        return dist.get_rank()


def config(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}


def train(engine, rank):
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    engine.destroy()
    return losses, params


def make_model(kind):
    torch.manual_seed(0)
    return TinyLM() if kind == "dp1" else M6GPT(M6_SMALL, ep_size=2, capacity_factor=2.0)


def run_case(case, rank, mpu):
    kind, stage = case.split(":")
    data_parallel = mpu.get_data_parallel_world_size() if mpu else dist.get_world_size()
    model = make_model(kind)
    groups = [param_group(size, ps, PlacementLevel.DEVICE)
              for size, ps in zip(*model_groups(model, "layers", data_parallel))]
    engine, *_ = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(groups, adamw_mode=True, **ADAM),
                                      mpu=mpu, config={**config(int(stage)), "zero_allow_untested_optimizer": True,
                                                       "zero_force_ds_cpu_optimizer": False})
    ref_losses, ref_params = train(engine, rank)
    model = make_model(kind)
    full = {**config(int(stage)), "optimizer": {"type": "AdamW", "params": ADAM},
            "granular_offload": {"levels": LEVELS[kind]}}
    optimizer, patched, _ = build_offload_optimizer(model, full, "layers", data_parallel)
    assert optimizer.own_param_groups, "the case is meant to have groups stepped outside DeepSpeed's optimizer"
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu, config=patched)
    attach_to_engine(engine)
    losses, params = train(engine, rank)
    optimizer.remove_hooks()
    return {"case": case, "rank": rank, "own_groups": [g["placement"] for g in optimizer.own_param_groups],
            "ref_losses": ref_losses, "losses": losses, "params_max_diff": float((ref_params - params).abs().max())}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank, mpu = dist.get_rank(), None
    cases = sys.argv[1:]
    assert cases == sorted(cases, key=lambda case: not case.startswith("m6:")), "m6 cases first"
    for case in cases:
        if case.startswith("dp1:") and mpu is None:
            mpu = OneRankDataParallel()
        sys.stdout.write("RESULT " + json.dumps(run_case(case, rank, mpu)) + "\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
