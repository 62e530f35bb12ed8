"""Train TinyLM under DeepSpeed with and without granular offload and print one JSON line of results per case.

Usage (1 rank with RANK/WORLD_SIZE/... set, or under torchrun): run_training.py CASE [CASE ...]
CASE = delink:STAGE:PSEUDO_LEVELS:REAL_LEVELS[:PSEUDO_EXPERTS:REAL_EXPERTS] trains the fully shared pseudo model,
delinks it in the same process and trains the real model, each with its own plan (with expert letters: the MoE
model, ep_size 1). CASE = moe:STAGE:EP_SIZE:LEVELS:EXPERT_LEVELS trains
the MoE model (fp32, experts over EP_SIZE ranks) with EXPERT_LEVELS one letter per layer's experts. Otherwise
CASE = STAGE:DTYPE:LEVELS[:GROUPS][@clipC], LEVELS one letter per parameter-owning layer then one for the rest:
d device, o host_optimizer, p host_params; e.g. 2:fp32:dodoo. GROUPS: train the pseudo model whose 4 layers share
GROUPS sets. @clipC sets gradient_clipping to C (default: DeepSpeed's, 1.0).
Results: losses of the reference (same Adam kernel, no offload) and of the granular run, the bytes held and moved
against the plan (in total and per group), and a checkpoint save/load trajectory check.
"""
import json
import os
import sys
import tempfile

import deepspeed
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

sys.path.insert(0, os.path.dirname(__file__))
from tiny_model import TinyLM, batch  # noqa: E402

from ds_pseudo_real.offload import (  # noqa: E402
    PlacementLevel, attach_to_engine, build_offload_optimizer, model_groups, param_group,
)
from ds_pseudo_real.sharing import apply_sharing, delink_layers  # noqa: E402

LETTERS = {"d": "device", "o": "host_optimizer", "p": "host_params"}
ADAM = {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}
STEPS = 4
# dynamic loss scaling from 2**8, doubled after every 2 steps without overflow (the scale changes within a test),
# halved at every overflow (hysteresis 1; DeepSpeed's default, 2, lets the first overflow pass)
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def ds_config(stage, dtype, clipping=None):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": ADAM}}
    if clipping is not None:
        config["gradient_clipping"] = clipping
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = dict(FP16)
    return config


def train(engine, rank, first, count, norms=None):
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if norms is not None:
            norm = engine.get_global_grad_norm()  # None where DeepSpeed does not compute it (fp32 ZeRO 0)
            norms.append(None if norm is None else float(norm))
    return losses


def flat_params(engine):
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])


def moved_bytes(optimizer):
    return optimizer.moved_bytes + (optimizer.host_params.fetched_bytes if optimizer.host_params else 0)


def parse(case):
    """``(stage, dtype, levels section, GROUPS or None, EP_SIZE or None)`` of a CASE."""
    if case.startswith("moe:"):
        _, stage, ep_size, letters, experts = case.split(":")
        levels = {**letter_levels(letters, 1), **expert_levels(experts, 1)}
        return int(stage), "fp32", levels, None, int(ep_size)
    stage, dtype, letters, *groups = case.split(":")
    groups = int(groups[0]) if groups else None
    return int(stage), dtype, letter_levels(letters, 4 // (groups or 4)), groups, None


def letter_levels(letters, size):
    """One letter per group leader (every ``size``-th layer), then one for ``other``."""
    return {("other" if i == len(letters) - 1 else str(i * size)): LETTERS[c] for i, c in enumerate(letters)}


def expert_levels(letters, size):
    """One letter per group leader's experts."""
    return {f"{i * size}.experts": LETTERS[c] for i, c in enumerate(letters)}


def make_model(groups, ep_size=None):
    torch.manual_seed(0)
    model = TinyLM(ep_size=ep_size)
    return apply_sharing(model, "layers", groups) if groups else model


def reference(stage, dtype, groups, rank, ep_size=None, world_size=1, clipping=None):
    model = make_model(groups, ep_size)
    config = {k: v for k, v in ds_config(stage, dtype, clipping).items() if k != "optimizer"}
    config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    # the same per-layer groups as the granular run (experts marked for DeepSpeed's MoE): ZeRO 1/2 flatten and
    # partition per group, and with one group instead the ZeRO 1 weights on 2 ranks came out different in the
    # last bit (losses still equal)
    groups = [param_group(size, ps, PlacementLevel.DEVICE) for size, ps in zip(*model_groups(model, "layers",
                                                                                           world_size))]
    optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **ADAM)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    norms = []
    losses = train(engine, rank, 0, STEPS, norms)
    params = flat_params(engine)
    engine.destroy()
    return losses, params, norms


def granular(stage, dtype, levels, groups, world_size, ep_size=None, clipping=None):
    model = make_model(groups, ep_size)
    config = ds_config(stage, dtype, clipping)
    config["granular_offload"] = {"levels": levels}
    optimizer, patched, plan = build_offload_optimizer(model, config, "layers", world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    return engine, optimizer, plan


def run_case(case, rank, world_size, checkpoint_dir):
    body, _, clip = case.partition("@clip")
    clipping = float(clip) if clip else None
    stage, dtype, levels, groups, ep_size = parse(body)
    ref_losses, ref_params, ref_norms = reference(stage, dtype, groups, rank, ep_size, world_size, clipping)
    engine, optimizer, plan = granular(stage, dtype, levels, groups, world_size, ep_size, clipping)
    norms = []
    losses = train(engine, rank, 0, STEPS - 1, norms)
    before, before_by_group = moved_bytes(optimizer), dict(optimizer.moved_bytes_by_group)
    losses += train(engine, rank, STEPS - 1, 1, norms)
    moved = moved_bytes(optimizer) - before
    moved_by_group = {k: v - before_by_group.get(k, 0) for k, v in optimizer.moved_bytes_by_group.items()}
    params = flat_params(engine)
    held = optimizer.held_bytes()
    held_by_group = optimizer.held_bytes_by_group()
    # checkpoint after STEPS and two more steps; then the same engine, and a fresh one, load it and replay them
    path = os.path.join(checkpoint_dir, case.replace(":", "_"))
    engine.save_checkpoint(path, tag="t")
    after_save = train(engine, rank, STEPS, 2)
    engine.load_checkpoint(path, tag="t")
    after_reload = train(engine, rank, STEPS, 2)
    engine.destroy()
    optimizer.remove_hooks()
    engine, optimizer, _ = granular(stage, dtype, levels, groups, world_size, ep_size, clipping)
    engine.load_checkpoint(path, tag="t")
    after_load = train(engine, rank, STEPS, 2)
    engine.destroy()
    return {
        "case": case, "rank": rank, "ref_losses": ref_losses, "losses": losses,
        "ref_norms": ref_norms, "norms": norms, "clipping": clipping,
        "params_equal": bool(torch.equal(ref_params, params)),
        "params_max_diff": float((ref_params - params).abs().max()),
        "levels": plan.levels(),
        "held": held, "moved": moved, "held_by_group": held_by_group, "moved_by_group": moved_by_group,
        "plan": {"device": plan.optimizer_device_bytes, "host": plan.optimizer_host_bytes,
                 "moved": plan.moved_bytes_per_step},
        "plan_by_group": {p.group.name: {"device": p.bytes.optimizer_device, "host": p.bytes.optimizer_host,
                                         "moved": p.bytes.moved_per_step, "numel": p.group.numel}
                          for p in plan.placements},
        "plan_placements": [{"name": p.group.name, "device": p.bytes.device} for p in plan.placements],
        "peak_buffer": optimizer.host_params.peak_buffered_bytes if optimizer.host_params else 0,
        "plan_buffer": plan.prefetch_buffer_bytes,
        "peak_streamed": optimizer.peak_streamed_gradient_bytes, "plan_streamed": plan.streamed_gradient_bytes,
        "own_groups": [g["placement"] for g in optimizer.own_param_groups],
        "after_save": after_save, "after_reload": after_reload, "after_load": after_load,
    }


def run_delink(case, rank, world_size):
    """The lead's in-process transition: plan + optimizer for the pseudo model, destroy, delink, plan again."""
    _, stage, pseudo_letters, real_letters, *experts = case.split(":")
    stage, ep_size = int(stage), (1 if experts else None)
    pseudo_levels, real_levels = letter_levels(pseudo_letters, 4), letter_levels(real_letters, 1)
    if experts:
        pseudo_levels.update(expert_levels(experts[0], 4))
        real_levels.update(expert_levels(experts[1], 1))
    engine, optimizer, pseudo_plan = granular(stage, "fp32", pseudo_levels, 1, world_size, ep_size)
    train(engine, rank, 0, 2)
    model = engine.module
    with torch.no_grad():
        pseudo_loss = engine(*batch(2, rank)).item()
    engine.destroy()
    optimizer.remove_hooks()
    delink_layers(model, "layers")
    config = ds_config(stage, "fp32")
    config["granular_offload"] = {"levels": real_levels}
    optimizer, patched, plan = build_offload_optimizer(model, config, "layers", world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    real_losses = train(engine, rank, 2, 2)
    before = moved_bytes(optimizer)
    train(engine, rank, 4, 1)
    result = {"case": case, "rank": rank, "pseudo_levels": pseudo_plan.levels(), "levels": plan.levels(),
              "pseudo_loss": pseudo_loss, "real_losses": real_losses, "moved": moved_bytes(optimizer) - before,
              "held": optimizer.held_bytes(),
              "plan": {"device": plan.optimizer_device_bytes, "host": plan.optimizer_host_bytes,
                       "moved": plan.moved_bytes_per_step},
              "pseudo_plan_host": pseudo_plan.optimizer_host_bytes}
    engine.destroy()
    return result


def main(cases):
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with tempfile.TemporaryDirectory() as local:
        shared = os.environ.get("OFFLOAD_TEST_DIR", local)
        for case in cases:
            run = run_delink(case, rank, world_size) if case.startswith("delink:") else \
                run_case(case, rank, world_size, shared)
            line = "RESULT " + json.dumps(run) + "\n"
            os.write(1, line.encode())  # one write: the two ranks' lines must not interleave
    torch.distributed.destroy_process_group()
    # the results are out: leave without the interpreter's teardown, where a C++ thread of gloo or DeepSpeed still
    # joinable under load can abort a rank (std::terminate) after a run that passed
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")])
