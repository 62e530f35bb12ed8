"""Train TinyLM with granular offload's host step after the backward (``sequential``) and during it
(``overlapped``), and print one JSON line per case: both runs' losses and whether their weights are equal, what the
overlapped run stepped ahead, redid and undid, the host bytes each run's optimizer held against its plan's, and a
resume of the overlapped run from a checkpoint.

Usage (1 rank with RANK/WORLD_SIZE/... set, or under torchrun): run_host_step.py CASE [CASE ...]
CASE = STAGE:DTYPE:LEVELS[:GA][@clipC][/sliceN]: ZeRO STAGE, DTYPE fp32/bf16/fp16, LEVELS one letter per layer then
one for the rest (d device, o host_optimizer, p host_params), GA micro-batches per step (default 1), C the
gradient clipping (default 0: none), N the elements per kernel call of a parameter stepped (default the module's).
An fp16 case puts an inf in one gradient at step :data:`OVERFLOW_AT` (a skipped step).
"""
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(__file__))
from run_training import ds_config, flat_params, letter_levels, make_model, run_each_case  # noqa: E402
from tiny_model import batch  # noqa: E402

from ds_pseudo_real.offload import ahead, attach_to_engine, build_offload_optimizer  # noqa: E402

STEPS = 5
SAVE_AFTER = 2  # the resumed run loads the checkpoint saved after this many steps
OVERFLOW_AT = 4  # after the step held sequential by the scale's growth at step 2: a step ahead is undone


def parse(case):
    body, _, slices = case.partition("/slice")
    body, _, clip = body.partition("@clip")
    stage, dtype, letters, *ga = body.split(":")
    return int(stage), dtype, letters, int(ga[0]) if ga else 1, float(clip or 0), int(slices or ahead.SLICE_NUMEL)


def build(case, host_step, world_size):
    stage, dtype, letters, ga, clip, _ = parse(case)
    config = ds_config(stage, dtype, clip)
    config["gradient_accumulation_steps"] = ga
    config["granular_offload"] = {"levels": letter_levels(letters, 1), "host_step": host_step}
    model = make_model(None)
    optimizer, patched, plan = build_offload_optimizer(model, config, "layers", world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
    attach_to_engine(engine)
    optimizer.plan = plan
    return engine, optimizer


def train(engine, rank, first, count, fp16):
    losses = []
    for step in range(first, first + count):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(100 * step + micro, rank)
            loss = engine(x, y)
            if fp16 and step == OVERFLOW_AT and micro == 0 and rank == 0:
                loss = loss * float("inf")  # every gradient inf: DeepSpeed skips the step on every rank
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def run_case(case, rank, world_size, checkpoint_dir):
    fp16 = parse(case)[1] == "fp16"
    ahead.SLICE_NUMEL = parse(case)[5]
    runs = {}
    for host_step in ("sequential", "overlapped"):
        engine, optimizer = build(case, host_step, world_size)
        held = {"built": optimizer.held_bytes()["host"]}  # before any step: the backups are there from the start
        losses = train(engine, rank, 0, SAVE_AFTER, fp16)
        if host_step == "overlapped":
            path = os.path.join(checkpoint_dir, case.replace(":", "_").replace("/", "_"))
            engine.save_checkpoint(path, tag="t")
        losses += train(engine, rank, SAVE_AFTER, STEPS - SAVE_AFTER, fp16)
        stats = ({k: getattr(optimizer.ahead, k) for k in ("stepped_ahead", "redone", "undone", "held")}
                 if optimizer.ahead is not None else None)
        held["trained"] = optimizer.held_bytes()["host"]
        held["plan"], held["plan_backups"] = optimizer.plan.optimizer_host_bytes, optimizer.plan.backup_bytes
        runs[host_step] = {"losses": losses, "params": flat_params(engine), "ahead": stats, "held": held,
                           "own_groups": [g["placement"] for g in optimizer.own_param_groups]}
        engine.destroy()
        optimizer.remove_hooks()
    engine, optimizer = build(case, "overlapped", world_size)
    engine.load_checkpoint(path, tag="t")
    resumed = train(engine, rank, SAVE_AFTER, STEPS - SAVE_AFTER, fp16)
    resumed_params = flat_params(engine)
    engine.destroy()
    optimizer.remove_hooks()
    seq, over = runs["sequential"], runs["overlapped"]
    return {
        "case": case, "rank": rank, "sequential": seq["losses"], "overlapped": over["losses"],
        "params_equal": bool(torch.equal(seq["params"], over["params"])),
        "resumed": resumed, "resumed_params_equal": bool(torch.equal(seq["params"], resumed_params)),
        "ahead": over["ahead"], "own_groups": over["own_groups"],
        "held": {"sequential": seq["held"], "overlapped": over["held"]},
        "own_numel": sum(p.numel() for g in optimizer.own_param_groups for p in g["params"]),
    }


if __name__ == "__main__":
    run_each_case(run_case)
