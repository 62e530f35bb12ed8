"""Train TinyLM under DeepSpeed with and without granular offload and print one JSON line of results per case.

Usage (1 rank with RANK/WORLD_SIZE/... set, or under torchrun): run_training.py CASE [CASE ...]
CASE = overflow:STAGE:LEVELS:PARAM trains in fp16 with an inf in PARAM's gradient on the last rank at one step, with
and without offload (``run_overflow``).
CASE = delink:STAGE:PSEUDO_LEVELS:REAL_LEVELS[:PSEUDO_EXPERTS:REAL_EXPERTS] trains the fully shared pseudo model,
delinks it in the same process and trains the real model, each with its own plan (with expert letters: the MoE
model, ep_size 1). CASE = moe:STAGE:EP_SIZE:LEVELS:EXPERT_LEVELS trains
the MoE model (fp32, experts over EP_SIZE ranks) with EXPERT_LEVELS one letter per layer's experts. Otherwise
CASE = STAGE:DTYPE:LEVELS[:GROUPS][@clipC] (DTYPE fp32, bf16 or fp16), LEVELS one letter per parameter-owning layer
then one for the rest:
d device, o host_optimizer, p host_params; e.g. 2:fp32:dodoo. GROUPS: train the pseudo model whose 4 layers share
GROUPS sets. @clipC sets gradient_clipping to C (default: DeepSpeed's, 1.0).
Results: losses and loss scaler states of the reference (same Adam kernel, no offload) and of the granular run, the
bytes held and moved against the plan (in total and per group), and a checkpoint save/load trajectory check. fp16 on
the CPU needs DeepSpeed's CPU accelerator to report it (tests/site/cpu_fp16.py).
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

from ds_pseudo_real import ds_state  # noqa: E402
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


def run_each_case(run_case) -> None:
    """A case script's main: ``run_case(case, rank, world_size, checkpoint_dir)`` for each case of the command line;
    each result printed as a JSON line after ``RESULT`` (``case_runs`` reads them)."""
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    checkpoint_dir = os.environ.get("OFFLOAD_TEST_DIR") or tempfile.mkdtemp()
    for case in sys.argv[1:]:
        print("RESULT " + json.dumps(run_case(case, rank, world_size, checkpoint_dir)), flush=True)
    leave()


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


def train(engine, rank, first, count, norms=None, scales=None):
    """Steps ``first`` .. ``first + count - 1``; the losses. ``norms`` and ``scales`` (lists): DeepSpeed's global
    gradient norm and its loss scaler's state after each step are appended."""
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
        if scales is not None:
            scales.append(ds_state.loss_scaler_state(engine))
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


def reference_engine(stage, dtype, groups, ep_size=None, world_size=1, clipping=None):
    """Plain DeepSpeed without the plugin, every group on the device, stepped by the kernel the offload uses."""
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
    return engine


def reference(stage, dtype, groups, rank, ep_size=None, world_size=1, clipping=None):
    engine = reference_engine(stage, dtype, groups, ep_size, world_size, clipping)
    norms, scales = [], []
    losses = train(engine, rank, 0, STEPS, norms, scales)
    params = flat_params(engine)
    engine.destroy()
    return losses, params, norms, scales


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
    ref_losses, ref_params, ref_norms, ref_scales = reference(stage, dtype, groups, rank, ep_size, world_size,
                                                              clipping)
    engine, optimizer, plan = granular(stage, dtype, levels, groups, world_size, ep_size, clipping)
    norms, scales = [], []
    losses = train(engine, rank, 0, STEPS - 1, norms, scales)
    before, before_by_group = moved_bytes(optimizer), dict(optimizer.moved_bytes_by_group)
    losses += train(engine, rank, STEPS - 1, 1, norms, scales)
    moved = moved_bytes(optimizer) - before
    moved_by_group = {k: v - before_by_group.get(k, 0) for k, v in optimizer.moved_bytes_by_group.items()}
    params = flat_params(engine)
    held = optimizer.held_bytes()
    held_by_group = optimizer.held_bytes_by_group()
    # checkpoint after STEPS and two more steps; then the same engine, and a fresh one, load it and replay them
    path = os.path.join(checkpoint_dir, case.replace(":", "_"))
    engine.save_checkpoint(path, tag="t")
    scales_after = {"save": [], "reload": [], "load": []}
    after_save = train(engine, rank, STEPS, 2, scales=scales_after["save"])
    engine.load_checkpoint(path, tag="t")
    after_reload = train(engine, rank, STEPS, 2, scales=scales_after["reload"])
    engine.destroy()
    optimizer.remove_hooks()
    engine, optimizer, _ = granular(stage, dtype, levels, groups, world_size, ep_size, clipping)
    engine.load_checkpoint(path, tag="t")
    after_load = train(engine, rank, STEPS, 2, scales=scales_after["load"])
    engine.destroy()
    return {
        "case": case, "rank": rank, "ref_losses": ref_losses, "losses": losses,
        "ref_norms": ref_norms, "norms": norms, "clipping": clipping, "ref_scales": ref_scales, "scales": scales,
        "scales_after": scales_after,
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


OVERFLOW_AT = 2  # the step whose gradient gets an inf in the overflow cases


def run_overflow(case, rank, world_size):
    """``overflow:STAGE:LETTERS:PARAM``: fp16 (dynamic loss scaling, no clipping) with an inf in the gradient of
    PARAM on the last rank alone at step :data:`OVERFLOW_AT`, without the plugin (every group on the device) and with
    granular offload at LETTERS; per step the losses, the skipped-step count, the loss scaler's state and this rank's
    weights of each run, and whether the offloaded weights equal the reference's."""
    _, stage, letters, param = case.split(":")
    stage, out = int(stage), {"case": case, "rank": rank}
    engines = {"ref": (reference_engine(stage, "fp16", None, world_size=world_size, clipping=0.0), None)}
    engine, optimizer, _ = granular(stage, "fp16", letter_levels(letters, 1), None, world_size, clipping=0.0)
    engines["granular"] = engine, optimizer
    weights = {}
    for arm, (engine, optimizer) in engines.items():
        clock = {"step": None}
        poisoned = rank == world_size - 1

        def poison(grad):
            if not poisoned or clock["step"] != OVERFLOW_AT:
                return grad
            return grad.index_fill(0, torch.tensor([0]), float("inf"))

        dict(engine.module.named_parameters())[param].register_hook(poison)
        run = out[arm] = {"losses": [], "skipped": [], "scales": []}
        weights[arm] = []
        for step in range(STEPS):
            clock["step"] = step
            run["losses"] += train(engine, rank, step, 1, scales=run["scales"])
            run["skipped"].append(engine.skipped_steps)
            weights[arm].append(flat_params(engine))
        run["own_groups"] = [g["placement"] for g in getattr(optimizer, "own_param_groups", [])]
        engine.destroy()
        if optimizer is not None:
            optimizer.remove_hooks()
    out["weights_equal"] = [bool(torch.equal(a, b)) for a, b in zip(weights["ref"], weights["granular"])]
    out["unchanged_at_overflow"] = {arm: bool(torch.equal(w[OVERFLOW_AT], w[OVERFLOW_AT - 1]))
                                    for arm, w in weights.items()}
    return out


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
            if case.startswith("delink:"):
                run = run_delink(case, rank, world_size)
            elif case.startswith("overflow:"):
                run = run_overflow(case, rank, world_size)
            else:
                run = run_case(case, rank, world_size, shared)
            line = "RESULT " + json.dumps(run) + "\n"
            os.write(1, line.encode())
    leave()


def leave() -> None:
    """The results are out: the process group destroyed, then exit without the interpreter's teardown, where a C++
    thread of gloo or DeepSpeed still joinable under load can abort a rank (std::terminate) after a run that
    passed."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")])
