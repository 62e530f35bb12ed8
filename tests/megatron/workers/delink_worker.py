"""Pseudo GPT under Megatron DDP (overlapped grad reduce) + optimizer on 2 gloo ranks, delinked in process at
iteration SWITCH; reports losses around the switch, the optimizer state every real parameter starts with, and
the size of the first update after the switch per kind of parameter.

Usage: delink_worker.py OUT.json SCENARIO... with SCENARIO = TP:POLICY:DISTOPT[:FLAG...], all run in one process
(one job start for all of them); OUT.json maps each scenario to its figures. Flags:
  moe       M6 MoE layers, 4 experts in 2 prototypes (at TP=2 with sequence parallelism, experts TP-split)
  ep2       MoE experts split over the 2 ranks, not TP-split
  drop      MoE capacity factor 1.0 (tokens dropped) and balance loss 0.01
  bf16      Float16Module + Megatron's bf16 optimizer
  fp16      the same in fp16, dynamic loss scale from 2**10, doubling every 2 steps without overflow
  noswitch  the pseudo model trains on: the control run
  samedata  every data-parallel rank gets the same batch (TP=1 x DP=2 and TP=2 x DP=1 see the same data)
  lrX       learning rate X instead of the default below
  groupstep Megatron's optimizer as built where Transformer Engine or apex is installed (their FusedAdam, which
            counts steps in each param group, not in the parameters' state): torch's AdamW with that bookkeeping
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_setup as ms
import torch
import torch.distributed as dist

from ds_pseudo_real import sharing
from megatron_patches.delink import delink_in_process, read_adam_states

SWITCH, STEPS, L = 3, 6, 4
QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"
EXPERT = "decoder.layers.{}.mlp.experts.local_experts.0.linear_fc1.weight"
# The tiny M6 MoE pseudo model is unstable at lr 1e-2 with or without a delink (the loss rises at step 4 with no
# switch at all), so MoE scenarios train at 3e-3 where the pseudo run keeps falling.
LR = {"dense": 1e-2, "moe": 3e-3}


def main():
    out_path, scenarios = sys.argv[1], sys.argv[2:]
    ms.report(out_path, {scenario: run_scenario(*scenario.split(":")) for scenario in scenarios})
    dist.destroy_process_group()


def category(name: str) -> str:
    """Which kind of parameter a name is, for the per-kind update sizes."""
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.router." in name:
        return "router"
    if "decoder.layers." in name:
        return "layer_norm" if "layernorm" in name else "dense"
    return "outside_layers"


class GroupStepAdamW(torch.optim.AdamW):
    """torch's AdamW (the same arithmetic) keeping its step count where Transformer Engine's and apex's FusedAdam,
    which a GPU machine has and this one cannot build, keep theirs: ``group["step"]``, an int, counted once per
    ``step()``; the parameters' state holds only the moments. Built as Megatron builds those, with ``adam_w_mode``."""

    def __init__(self, params, adam_w_mode=True, **kwargs):
        assert adam_w_mode, "Megatron's default, decoupled weight decay"
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if self.state[p]:  # torch's AdamW counts on from the state: give it the group's count
                    self.state[p]["step"] = torch.tensor(float(group["step"] - 1))
        loss = super().step(closure)
        for state in self.state.values():
            state.pop("step", None)
        return loss


def use_group_step_adam():
    """Make ``get_megatron_optimizer`` build :class:`GroupStepAdamW` where it would build TE's/apex's FusedAdam."""
    import megatron.core.optimizer as mco

    mco.Adam, mco.USING_PYTORCH_OPTIMIZER = GroupStepAdamW, False


def run_scenario(tp, policy, distopt, *flags):
    """Scenario ``TP:POLICY:DISTOPT[:FLAG...]`` (see the module's docstring): the pseudo GPT trained for STEPS steps
    and delinked at SWITCH with ``policy``; its figures."""
    tp, distopt, flags = int(tp), distopt == "1", set(flags)
    ep = 2 if "ep2" in flags else 1
    etp = 1 if ep > 1 else tp
    ms.init(tp=tp, ep=ep, etp=etp)
    from megatron.core import parallel_state
    import megatron.core.optimizer as mco

    torch_adam = (mco.Adam, mco.USING_PYTORCH_OPTIMIZER)
    if "groupstep" in flags:
        use_group_step_adam()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg, spec, lr = scenario_config(tp, ep, etp, flags)
    wrap = ddp_and_optimizer(cfg, lr, distopt, "bf16" in flags, "fp16" in flags)
    chunks, optimizer = wrap(ms.gpt(cfg, spec, shared_groups=1))
    pseudo_params = sharing.parameter_count(gpt_in(chunks[0]))
    tokens, pos, mask, _ = ms.batch(seed=7 + (0 if "samedata" in flags else parallel_state.get_data_parallel_rank()))
    forward_step = summed_loss_step(tokens, pos, mask)
    run = get_forward_backward_func()

    def evaluate(model):
        return mean_loss(run(forward_step_func=forward_step, data_iterator=iter([None]), model=model,
                             num_microbatches=1, seq_length=ms.SEQ, micro_batch_size=ms.BATCH, forward_only=True))

    losses, result = [], {}
    for step in range(STEPS):
        if step == SWITCH and "noswitch" not in flags:
            chunks, optimizer, figures = delink_and_check(chunks, optimizer, lambda: wrap(ms.gpt(cfg, spec, seed=3)),
                                                          policy, evaluate)
            result.update(figures)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = run(forward_step_func=forward_step, data_iterator=iter([None, None]), model=chunks,
                      num_microbatches=2, seq_length=ms.SEQ, micro_batch_size=ms.BATCH, forward_only=False)
        before = {n: p.detach().float().clone() for n, p in gpt_in(chunks[0]).named_parameters()}
        optimizer.step()
        if step == SWITCH:
            result["first_update_norm"] = update_norms(gpt_in(chunks[0]), before)
        losses.append(mean_loss(reports))
    mco.Adam, mco.USING_PYTORCH_OPTIMIZER = torch_adam
    result.update(final_figures(gpt_in(chunks[0]), optimizer, "moe" in flags, lambda: evaluate(chunks)))
    result.update({"losses": losses, "pseudo_params": pseudo_params})
    return result


def scenario_config(tp, ep, etp, flags):
    """The scenario's model: its transformer config (4 layers; M6 MoE with ``moe``, sequence parallel at TP > 1;
    bf16 or fp16), its layer spec (None: dense) and its learning rate."""
    from megatron_patches.moe import m6_layer_spec, m6_moe_config

    moe = "moe" in flags
    spec = m6_layer_spec(4, 2) if moe else None
    routing = dict(capacity_factor=1.0, balance_loss_coeff=0.01) if "drop" in flags else dict(capacity_factor=2.0)
    extra = m6_moe_config(4, 2, **routing) if moe else {}  # capacity factor 2.0 (top-1 of 2 experts): none dropped
    cfg = ms.config(num_layers=L, tp=tp, ep=ep, expert_tensor_parallel_size=etp, sequence_parallel=moe and tp > 1,
                    bf16="bf16" in flags, fp16="fp16" in flags, **extra)
    lr = next((float(f[2:]) for f in flags if f.startswith("lr")), LR["moe" if moe else "dense"])
    return cfg, spec, lr


def ddp_and_optimizer(cfg, lr, distopt, bf16, fp16):
    """A function wrapping a model in Megatron's DDP (overlapped grad reduce; in Float16Module for ``bf16`` or
    ``fp16``) and building its optimizer (Adam at ``lr``, the DistributedOptimizer with ``distopt``), the train hooks
    of ``cfg`` pointed at both; it returns the chunks and the optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    def wrap(model):
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                   use_distributed_optimizer=distopt)
        chunks = [DistributedDataParallel(config=cfg, ddp_config=ddp_config,
                                          module=Float16Module(cfg, model) if bf16 or fp16 else model)]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, bf16=bf16,
                                                           fp16=fp16, initial_loss_scale=2**10, loss_scale_window=2,
                                                           clip_grad=1.0,
                                                           use_distributed_optimizer=distopt), chunks)
        cfg.grad_scale_func = optimizer.scale_loss
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.no_sync_func = chunks[0].no_sync
        cfg.grad_sync_func = chunks[0].start_grad_sync
        return chunks, optimizer
    return wrap


def gpt_in(chunk):
    """The GPT model inside a DDP chunk (and its Float16Module, if any)."""
    from megatron.core.transformer.module import Float16Module

    module = chunk.module
    return module.module if isinstance(module, Float16Module) else module


def summed_loss_step(tokens, pos, mask):
    """A Megatron ``forward_step`` on one fixed batch: the loss is the sum of the per-token losses, reported as
    ``lm loss`` with the token count, for :func:`mean_loss`."""
    def forward_step(data, model):
        out = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1))
        return out, lambda o: (o.float().sum(), torch.tensor(o.numel(), dtype=torch.int),
                               {"lm loss": torch.stack([o.float().sum().detach(), torch.tensor(float(o.numel()))])})
    return forward_step


def mean_loss(reports):
    """The mean per-token loss over the micro-batches' ``lm loss`` reports of :func:`summed_loss_step`."""
    return float(sum(r["lm loss"][0] for r in reports) / sum(r["lm loss"][1] for r in reports))


def delink_and_check(chunks, optimizer, build_real, policy, evaluate):
    """The delink in process with ``policy``: the real chunks and optimizer (``build_real`` makes them), and the
    figures around it: the evaluation loss and loss scale before and after, the real parameter count and the
    state every real parameter starts with (:func:`check_carried_state`)."""
    figures = {"pre_switch_eval": evaluate(chunks), "loss_scale_pre": float(optimizer.get_loss_scale())}
    pseudo = chunks[0].module
    shared = read_adam_states(pseudo, optimizer)
    pseudo_named = dict(pseudo.named_parameters(remove_duplicate=False))
    chunks, optimizer = delink_in_process(chunks, optimizer, build_real, policy)
    figures["post_switch_eval"] = evaluate(chunks)
    figures["loss_scale_post"] = float(optimizer.get_loss_scale())
    figures["real_params"] = sharing.parameter_count(gpt_in(chunks[0]))
    figures.update(check_carried_state(chunks[0].module, optimizer, shared, pseudo_named, policy))
    return chunks, optimizer, figures


def final_figures(real, optimizer, moe, evaluate):
    """The trained model's figures: whether its layers differ (and, with ``moe``, its experts), whether the
    data-parallel ranks hold the same weights, the final evaluation loss (``evaluate()``) and the optimizer's
    classes (Megatron's and torch's inside it)."""
    from megatron.core import parallel_state

    probe = real.get_parameter(QKV.format(1)).detach().float().clone()
    group = parallel_state.get_data_parallel_group()
    synced = probe.clone()
    dist.all_reduce(synced, group=group)
    figures = {}
    if moe:
        figures["experts_differ"] = not torch.equal(real.get_parameter(EXPERT.format(0)),
                                                    real.get_parameter(EXPERT.format(L - 1)))
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    figures.update({"final_eval": evaluate(),
                    "layers_differ": not torch.equal(real.get_parameter(QKV.format(0)).float(), probe),
                    "dp_in_sync": bool(torch.allclose(synced / group.size(), probe, atol=1e-6)),
                    "optimizer": type(inner).__name__,
                    "torch_optimizer": type(getattr(inner, "optimizer", None)).__name__})
    return figures


def check_carried_state(real, optimizer, shared, pseudo_named, policy):
    """Every real parameter's master, moments and step against the shared parameter it came from, exactly.

    Expected per policy: copy -> the shared moments; scale -> first / n, second / n**2 (n = layers that shared the
    parameter: L inside the block, 1 outside); reset -> no moments, step 0; the master is always the shared one."""
    uses = {}
    for param in pseudo_named.values():
        uses[id(param)] = uses.get(id(param), 0) + 1
    carried = read_adam_states(real, optimizer)
    mismatches, checked = [], 0
    for name, param in real.named_parameters():
        got, source = carried[id(param)], pseudo_named[name]
        want, n = shared[id(source)], uses[id(source)]
        expected = {"main": want["main"]}
        if policy == "reset":
            ok_moments = float(got.get("step", torch.zeros(()))) == 0 and all(
                float(got[k].abs().sum()) == 0 for k in ("exp_avg", "exp_avg_sq") if k in got)
        else:
            divisor = n if policy == "scale" else 1
            expected.update(step=want["step"], exp_avg=want["exp_avg"] / divisor,
                            exp_avg_sq=want["exp_avg_sq"] / divisor**2)
            ok_moments = True
        if not ok_moments or any(not torch.equal(got[k].float(), v.float()) for k, v in expected.items()):
            mismatches.append(name)
        checked += 1
    routed = [p for n, p in real.named_parameters() if ".mlp.experts." in n or ".mlp.router." in n]
    nonzero = policy == "reset" or all(float(carried[id(p)]["exp_avg_sq"].abs().sum()) > 0 for p in routed)
    per_rank = [None] * dist.get_world_size()  # expert-parallel ranks hold different experts: report them all
    dist.all_gather_object(per_rank, (mismatches, checked, nonzero))
    return {"state_mismatches": [f"rank{r}:{name}" for r, (names, _, _) in enumerate(per_rank) for name in names],
            "states_checked": min(c for _, c, _ in per_rank), "members_max": max(uses.values()),
            "carried_nonzero": all(ok for _, _, ok in per_rank)}


def update_norms(model, before):
    """L2 norm of the optimizer's update per kind of parameter (this rank's parameters)."""
    squares = {}
    for name, param in model.named_parameters():
        kind = category(name)
        squares[kind] = squares.get(kind, 0.0) + float((param.detach().float() - before[name]).pow(2).sum())
    return {kind: value ** 0.5 for kind, value in squares.items()}


if __name__ == "__main__":
    main()
