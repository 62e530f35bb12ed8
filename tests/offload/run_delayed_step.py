"""Train TinyLM with granular offload's host step one step late (``host_step: "delayed"``) and, as its reference, with
the sequential host step where the forward and backward of each step are made to read the own groups' host params
as they were before the last update (their current values put back before the step); print one JSON line per case:
both runs' losses, whether their weights are equal, a plain sequential run's losses and plan, the delayed run's
counts, its host bytes against its plan's, and a resume of the delayed run from a checkpoint.

Usage (1 rank with RANK/WORLD_SIZE/... set, or under torchrun): run_delayed_step.py CASE [CASE ...]
CASE = STAGE:DTYPE:LEVELS[:GA][@clipC][/fromN]: as ``run_host_step.py``, N the ``delayed_from_step`` (default 0).
An fp16 case puts an inf in one gradient at step :data:`OVERFLOW_AT` (a skipped step).
"""
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(__file__))
from run_training import ds_config, flat_params, letter_levels, make_model, run_each_case  # noqa: E402
from tiny_model import batch  # noqa: E402

from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer  # noqa: E402

STEPS = 6
SAVE_AFTER = 3  # the resumed run loads the checkpoint saved after this many steps
OVERFLOW_AT = 4


def parse(case):
    body, _, start = case.partition("/from")
    body, _, clip = body.partition("@clip")
    stage, dtype, letters, *ga = body.split(":")
    return int(stage), dtype, letters, int(ga[0]) if ga else 1, float(clip or 0), int(start or 0)


def build(case, host_step, world_size):
    stage, dtype, letters, ga, clip, start = parse(case)
    config = ds_config(stage, dtype, clip)
    config["gradient_accumulation_steps"] = ga
    config["granular_offload"] = {"levels": letter_levels(letters, 1), "host_step": host_step}
    if host_step == "delayed":
        config["granular_offload"]["delayed_from_step"] = start
    model = make_model(None)
    optimizer, patched, plan = build_offload_optimizer(model, config, "layers", world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    optimizer.plan = plan
    return engine, optimizer


def own_hosts(optimizer):
    return [optimizer.host_params.host_tensor(p) for g in optimizer.own_param_groups for p in g["params"]]


def train(engine, optimizer, rank, first, count, fp16, stale_reference=False, start=0):
    """Steps ``first`` .. ``first + count - 1``; the losses. ``stale_reference``: the sequential run made to read,
    in each step from ``start`` + 1 on, the own groups' host params of before the last applied update."""
    losses, stale = [], None
    for step in range(first, first + count):
        hosts = own_hosts(optimizer) if stale_reference else []
        current = None
        if stale is not None:
            current = [t.clone() for t in hosts]
            for t, s in zip(hosts, stale):
                t.copy_(s)
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(100 * step + micro, rank)
            loss = engine(x, y)
            if fp16 and step == OVERFLOW_AT and micro == 0 and rank == 0:
                loss = loss * float("inf")  # every gradient inf: DeepSpeed skips the step on every rank
            engine.backward(loss)
            if micro == engine.gradient_accumulation_steps() - 1 and current is not None:
                for t, c in zip(hosts, current):
                    t.copy_(c)
            before = [t.clone() for t in hosts] if step >= start else None
            engine.step()
            losses.append(loss.item())
        if stale_reference and engine.was_step_applied():
            stale = before  # a skipped step keeps what the delayed run publishes: nothing new
    return losses


def run_case(case, rank, world_size, checkpoint_dir):
    fp16, start = parse(case)[1] == "fp16", parse(case)[5]
    engine, optimizer = build(case, "sequential", world_size)
    sequential = train(engine, optimizer, rank, 0, STEPS, fp16)
    sequential_plan = optimizer.plan.optimizer_host_bytes
    engine.destroy()
    optimizer.remove_hooks()
    engine, optimizer = build(case, "sequential", world_size)
    reference = train(engine, optimizer, rank, 0, STEPS, fp16, stale_reference=True, start=start)
    reference_params = flat_params(engine)
    engine.destroy()
    optimizer.remove_hooks()

    engine, optimizer = build(case, "delayed", world_size)
    held_built = optimizer.held_bytes()["host"]
    losses = train(engine, optimizer, rank, 0, SAVE_AFTER, fp16)
    path = os.path.join(checkpoint_dir, case.replace(":", "_").replace("/", "_"))
    engine.save_checkpoint(path, tag="t")
    losses += train(engine, optimizer, rank, SAVE_AFTER, STEPS - SAVE_AFTER, fp16)
    delayed = optimizer.delayed
    counts = None if delayed is None else {"delayed": delayed.delayed, "published": delayed.published}
    held = {"built": held_built, "trained": optimizer.held_bytes()["host"],
            "plan": optimizer.plan.optimizer_host_bytes}
    optimizer.remove_hooks()  # publishes the step in flight
    params = flat_params(engine)
    own_numel = sum(p.numel() for g in optimizer.own_param_groups for p in g["params"])
    engine.destroy()

    engine, optimizer = build(case, "delayed", world_size)
    engine.load_checkpoint(path, tag="t")
    resumed = train(engine, optimizer, rank, SAVE_AFTER, STEPS - SAVE_AFTER, fp16)
    optimizer.remove_hooks()
    resumed_params = flat_params(engine)
    engine.destroy()
    return {
        "case": case, "rank": rank, "reference": reference, "delayed": losses, "sequential": sequential,
        "sequential_plan": sequential_plan,
        "params_equal": bool(torch.equal(reference_params, params)), "counts": counts, "held": held,
        "own_numel": own_numel, "resumed": resumed, "resumed_params_equal": bool(torch.equal(params, resumed_params)),
    }


if __name__ == "__main__":
    run_each_case(run_case)
