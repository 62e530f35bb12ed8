"""Pseudo GPT under Megatron DDP (overlapped grad reduce) + optimizer on 2 gloo ranks, delinked in process at
iteration SWITCH; reports losses around the switch and the optimizer moments the real layers start with.

Usage: delink_worker.py OUT.json SCENARIO... with SCENARIO = TP:POLICY:DISTOPT[:moe], all run in one process
(one job start for all of them); OUT.json maps each scenario to its figures."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_setup as ms
import torch
import torch.distributed as dist

from ds_pseudo_real import sharing
from megatron_patches.delink import _read_moments, delink_in_process
from megatron_patches.moe import m6_layer_spec, m6_moe_config

SWITCH, STEPS, L = 3, 6, 4
QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"


def main():
    out_path, scenarios = sys.argv[1], sys.argv[2:]
    ms.report(out_path, {scenario: run_scenario(*scenario.split(":")) for scenario in scenarios})
    dist.destroy_process_group()


def run_scenario(tp, policy, distopt, *extra):
    tp, distopt = int(tp), distopt == "1"
    moe = extra == ("moe",)  # M6 MoE layers, 4 experts in 2 prototypes, EP=2
    ep = 2 if moe else 1
    ms.init(tp=tp, ep=ep)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = m6_layer_spec(4, 2) if moe else None
    cfg = ms.config(num_layers=L, tp=tp, ep=ep, **(m6_moe_config(4, 2, capacity_factor=2.0) if moe else {}))

    def wrap(modules):
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                   use_distributed_optimizer=distopt)
        chunks = [DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=m) for m in modules]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01,
                                                           use_distributed_optimizer=distopt, clip_grad=1.0), chunks)
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.no_sync_func = chunks[0].no_sync
        cfg.grad_sync_func = chunks[0].start_grad_sync
        return chunks, optimizer

    chunks, optimizer = wrap([ms.gpt(cfg, spec, shared_groups=1)])
    pseudo_params = sharing.parameter_count(chunks[0].module)
    tokens, pos, mask, _ = ms.batch(seed=7 + parallel_state.get_data_parallel_rank())

    def forward_step(data, model):
        out = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1))
        return out, lambda o: (o.float().sum(), torch.tensor(o.numel(), dtype=torch.int),
                               {"lm loss": torch.stack([o.float().sum().detach(), torch.tensor(float(o.numel()))])})

    run = get_forward_backward_func()

    def mean_loss(reports):
        return float(sum(r["lm loss"][0] for r in reports) / sum(r["lm loss"][1] for r in reports))

    def evaluate():
        return mean_loss(run(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks,
                             num_microbatches=1, seq_length=ms.SEQ, micro_batch_size=ms.BATCH, forward_only=True))

    losses, result = [], {}
    for step in range(STEPS):
        if step == SWITCH:
            result["pre_switch_eval"] = evaluate()
            shared = {k: v.clone() for k, v in _read_moments(chunks[0].module, optimizer)[
                id(chunks[0].module.get_parameter(QKV.format(0)))].items()}
            chunks, optimizer = delink_in_process(chunks, optimizer, lambda: wrap([ms.gpt(cfg, spec, seed=3)]), policy)
            result["post_switch_eval"] = evaluate()
            real = chunks[0].module
            result["real_params"] = sharing.parameter_count(real)
            carried = _read_moments(real, optimizer)
            last = carried.get(id(real.get_parameter(QKV.format(L - 1))), {})
            if policy == "reset":
                result["moments_ok"] = not last or (float(last["step"]) == 0 and float(last["exp_avg"].abs().sum()) == 0)
            else:
                scale = 1.0 if policy == "copy" else 1.0 / L
                result["moments_ok"] = (torch.equal(last["step"], shared["step"]) and
                                        torch.allclose(last["exp_avg"], shared["exp_avg"] * scale, rtol=1e-6, atol=0) and
                                        torch.allclose(last["exp_avg_sq"], shared["exp_avg_sq"] * scale**2, rtol=1e-6, atol=0))
            result["shared_exp_avg_norm"] = float(shared["exp_avg"].norm())
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = run(forward_step_func=forward_step, data_iterator=iter([None, None]), model=chunks,
                      num_microbatches=2, seq_length=ms.SEQ, micro_batch_size=ms.BATCH, forward_only=False)
        optimizer.step()
        losses.append(mean_loss(reports))
    probe = chunks[0].module.get_parameter(QKV.format(1)).detach().clone()
    group = parallel_state.get_data_parallel_group()
    synced = probe.clone()
    dist.all_reduce(synced, group=group)
    if moe:
        expert = "decoder.layers.{}.mlp.experts.local_experts.0.linear_fc1.weight"
        result["experts_differ"] = not torch.equal(chunks[0].module.get_parameter(expert.format(0)),
                                                   chunks[0].module.get_parameter(expert.format(L - 1)))
    result.update({"losses": losses, "pseudo_params": pseudo_params, "final_eval": evaluate(),
                   "layers_differ": not torch.equal(chunks[0].module.get_parameter(QKV.format(0)), probe),
                   "dp_in_sync": bool(torch.allclose(synced / group.size(), probe, atol=1e-6))})
    return result


if __name__ == "__main__":
    main()
