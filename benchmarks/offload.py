"""Granular offload against no offload, ZeRO-2 full ``offload_optimizer: cpu`` and ZeRO-3 ``offload_optimizer.ratio``.

Per arm: median step time, peak device memory (``torch.cuda.max_memory_allocated``, CUDA only) and losses; for the
granular arm also the plan and the bytes the optimizer holds and moves against the plan's prediction, and its peak
against the plan's device total plus the activation estimate. On CPU the step times say little (the "device" is the
host): what counts there is exactness (the granular losses equal the no-offload losses with the same Adam kernel and
param groups) and the accounting. The paths a real run takes are options: gradient accumulation, each layer under
``torch.utils.checkpoint``, bf16, fp16 with dynamic loss scaling, and a step DeepSpeed skips (an inf gradient
injected). Prints a table and the ratios, writes JSON.

    python benchmarks/offload.py --layers 8 --d-model 256 --device-memory 100MB           # CPU: exactness + bytes
    python benchmarks/offload.py --layers 8 --d-model 256 --device-memory 60MB --max-level host_params \
        --gradient-clipping 0 --gradient-accumulation 2 --checkpoint-activations non-reentrant --skip-step 3
    python benchmarks/offload.py --layers 24 --d-model 2048 --bf16 --device-memory 12GB --arms all  # GPU: time + memory
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, build_gpt, init_single_process, machine_description, markdown_table, write_json  # noqa: E402

ARMS = ("none", "zero2_offload", "zero3_ratio", "granular")
# The no-offload arm's Adam on CUDA: torch's fused AdamW through DeepSpeed's ``torch_adam`` (its other parameters go to
# torch's constructor), the kernel the granular arm's device groups step with. DeepSpeed's own choice for "AdamW",
# its FusedAdam, is built with nvcc at its first use: a CUDA toolkit the GPU machine may lack, and minutes inside a
# step's cap of benchmarks/gpu/check.sh. (On the CPU the arm steps with DeepSpeed's CPU Adam, as granular does.)
CUDA_NO_OFFLOAD_ADAM = {"torch_adam": True, "fused": True}
# --check, relative to the loss, where the arms may round differently: on CUDA (no offload steps every group with
# torch's fused Adam, granular its host groups with DeepSpeed's CPU kernel), and in bf16 with gradient accumulation
# (the host_params layers DeepSpeed does not hold add their micro-batches' gradients in fp32 on the host, DeepSpeed in
# bf16: 1.5e-5 measured on the CPU), and so in fp16. The CUDA figures are estimates, not yet measured on a GPU: the
# check prints the difference found. Elsewhere the losses must be equal.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-3, "fp16": 1e-3}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="timed steps after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="micro-batches per optimizer step "
                        "(DeepSpeed's gradient_accumulation_steps); a step's time covers all of them")
    parser.add_argument("--checkpoint-activations", choices=("non-reentrant", "reentrant"), help="run each layer "
                        "under torch.utils.checkpoint of that kind (the layer's call, offload hooks included)")
    parser.add_argument("--skip-step", type=int, help="inject an inf into one gradient of the middle layer at this "
                        "optimizer step (0-based, warmup included), so that DeepSpeed skips it (ZeRO 1/2, or bf16)")
    parser.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage of the none and granular arms")
    dtypes = parser.add_mutually_exclusive_group()
    dtypes.add_argument("--bf16", action="store_true")
    dtypes.add_argument("--fp16", action="store_true", help="fp16 with DeepSpeed's dynamic loss scaling")
    parser.add_argument("--device-memory", default="4MB", help="granular budget per device, e.g. 20GB")
    parser.add_argument("--max-level", default="host_optimizer")
    parser.add_argument("--reserved", default="0", help="granular_offload.reserved; 0: the plan's device total is "
                        "compared with torch.cuda.max_memory_allocated, which holds neither the CUDA context nor NCCL")
    parser.add_argument("--reduce-bucket-size", type=float, help="zero_optimization.reduce_bucket_size of every arm; "
                        "default: the model's parameter count, at most DeepSpeed's 5e8 (a bucket never needs more "
                        "than every gradient, and 5e8 would put 2 GB of fp32 bucket beside a small model)")
    parser.add_argument("--gradient-clipping", type=float, default=1.0, help="DeepSpeed's gradient_clipping (its "
                        "default 1.0); 0 keeps host_params groups bit-exact against the no-offload arm on CPU")
    parser.add_argument("--ratio", type=float, default=0.5, help="ZeRO-3 offload_optimizer.ratio")
    parser.add_argument("--arms", default="none,granular", help=f"comma list of {ARMS} or 'all'")
    parser.add_argument("--out", default=str(RESULTS / "offload.json"))
    parser.add_argument("--check", action="store_true", help="exit 1 unless every arm ran, the granular arm's bytes "
                        "equal the plan, the injected inf was skipped by every arm, and the granular losses equal no "
                        "offload's (within LOSS_TOLERANCE where the arms round differently: on CUDA, and in bf16 or fp16 "
                        "with gradient accumulation)")
    parser.add_argument("--one-arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = parser.parse_args(argv)
    if args.gradient_accumulation < 1:
        parser.error(f"--gradient-accumulation: got {args.gradient_accumulation}; accepted: an integer >= 1")
    if args.skip_step is not None and not 0 <= args.skip_step < args.warmup + args.steps:
        parser.error(f"--skip-step: got {args.skip_step}; accepted: 0 to {args.warmup + args.steps - 1} "
                     f"(--warmup + --steps - 1)")
    return args


def base_config(args, stage: int, numel: int) -> Dict:
    """The DeepSpeed config of every arm, for a model of ``numel`` parameters."""
    from ds_pseudo_real.offload.config import REDUCE_BUCKET_SIZE

    bucket = int(args.reduce_bucket_size or min(REDUCE_BUCKET_SIZE, numel))
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": args.gradient_accumulation,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "gradient_clipping": args.gradient_clipping}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:  # dynamic loss scaling from 2**8 (DeepSpeed's default, 2**16, skips the first steps for overflow
        # until the scale finds its level: --skip-step's must be the one step skipped), halved at every overflow
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    return config


def dtype(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


class CheckpointedCall:
    """Mixin of a layer class: calling the layer runs its whole call, hooks included, under
    ``torch.utils.checkpoint``, so that the recompute in backward runs the offload's forward hooks again (as
    Megatron's and DeepSpeed's checkpointing of a layer do). Parameters and their names are the layer's own."""

    use_reentrant = False

    def __call__(self, *inputs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().__call__, *inputs, use_reentrant=self.use_reentrant)


def build_model(args):
    """The seed-0 GPT of every arm; with ``--checkpoint-activations`` each of its layers a ``CheckpointedCall``."""
    import torch

    torch.manual_seed(0)
    model = build_gpt(args.layers, args.d_model, args.heads, args.seq_len)
    if args.checkpoint_activations:
        for layer in model.layers:
            layer.__class__ = type(f"Checkpointed{type(layer).__name__}", (CheckpointedCall, type(layer)), {})
            layer.use_reentrant = args.checkpoint_activations == "reentrant"
    return model


def build_arm(arm: str, args):
    """(engine, granular optimizer or None, plan or None) for one arm, from the same seed-0 model."""
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer, model_groups

    model = build_model(args)
    numel = sum(p.numel() for p in model.parameters())
    if arm == "granular":
        config = base_config(args, args.zero_stage, numel)
        config["granular_offload"] = {"device_memory": args.device_memory, "max_level": args.max_level,
                                      "reserved": args.reserved}
        optimizer, config, plan = build_offload_optimizer(model, config, "layers", int(os.environ.get("WORLD_SIZE", 1)))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        attach_to_engine(engine)
        return engine, optimizer, plan
    if arm == "none" and not torch.cuda.is_available():
        # the same Adam kernel and the same per-layer groups as the granular arm, so losses must be identical
        config = base_config(args, args.zero_stage, numel)
        params = config.pop("optimizer")["params"]
        config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        optimizer = DeepSpeedCPUAdam([{"params": ps} for ps in model_groups(model, "layers")[1]], **params)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, None, None
    stage = {"none": args.zero_stage, "zero2_offload": 2, "zero3_ratio": 3}[arm]
    config = base_config(args, stage, numel)
    if arm == "zero2_offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if arm == "zero3_ratio":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": args.ratio}
        # several sub-groups per rank, else the ratio has nothing to split
        config["zero_optimization"]["sub_group_size"] = max(1, numel // (2 * args.layers))
    if arm == "none":  # on CUDA
        config["optimizer"]["params"].update(CUDA_NO_OFFLOAD_ADAM)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, None, None


def run_arm(arm: str, args) -> Dict:
    import torch

    from ds_pseudo_real.offload import describe_offload_plan

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        engine, optimizer, plan = build_arm(arm, args)
    except torch.cuda.OutOfMemoryError as error:  # "no offload when it fits"
        return {"arm": arm, "error": f"out of memory: {str(error).splitlines()[0]}"}
    rank = torch.distributed.get_rank()
    clock = {"step": None, "micro": None}
    if args.skip_step is not None:
        name, param = poisoned_parameter(engine.module, args.layers)
        param.register_hook(lambda grad: poison(grad) if (clock["step"], clock["micro"]) == (args.skip_step, 0)
                            else grad)
    losses, times, moved = [], [], None
    for step in range(args.warmup + args.steps):
        clock["step"] = step
        before = offload_bytes(optimizer)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for micro in range(args.gradient_accumulation):
            clock["micro"] = micro
            g = torch.Generator().manual_seed(1000 * rank + args.gradient_accumulation * step + micro)
            x = torch.randint(0, 256, (args.micro_batch, args.seq_len), generator=g).to(engine.device)
            loss = engine(x, x.roll(-1, 1))
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the last micro-batch only
            losses.append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        if optimizer and step != args.skip_step:
            moved = {k: v - before[k] for k, v in offload_bytes(optimizer).items()}
    result = {"arm": arm, "step_s_median": statistics.median(times), "losses": losses,
              "skipped_steps": engine.skipped_steps,
              "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    if args.skip_step is not None:
        result["poisoned_parameter"] = name
    if plan is not None:
        held = optimizer.held_bytes()
        result["plan"] = {"levels": plan.levels(), "table": describe_offload_plan(plan),
                          "predicted": {"optimizer_device": plan.optimizer_device_bytes,
                                        "optimizer_host": plan.optimizer_host_bytes,
                                        "moved_per_step": plan.moved_bytes_per_step,
                                        "device_total": plan.device_bytes,
                                        "host_allocated": plan.host_allocated_bytes,
                                        "offload_s_per_step": plan.offload_seconds_per_step,
                                        "activations_estimate": activations_estimate(args)},
                          "measured": {"optimizer_device": held["device"], "optimizer_host": held["host"],
                                       "moved_per_step": sum(moved.values()) if moved else None,
                                       "moved_per_step_parts": moved}}
    engine.destroy()
    del engine, optimizer
    gc.collect()
    return result


def offload_bytes(optimizer) -> Dict[str, int]:
    """Bytes the granular optimizer has moved so far: optimizer traffic (gradients and parameters between host and
    device around its step) and host_params fetches; zeros without it."""
    if optimizer is None:
        return {"optimizer": 0, "host_params_fetched": 0}
    return {"optimizer": optimizer.moved_bytes,
            "host_params_fetched": optimizer.host_params.fetched_bytes if optimizer.host_params else 0}


def poisoned_parameter(model, num_layers: int):
    """(name, parameter) whose gradient ``--skip-step`` poisons: the first of the middle layer, the same in every
    arm (one of the granular optimizer's own groups when that layer is at host_params)."""
    prefix = f"layers.{num_layers // 2}."
    return next((n, p) for n, p in model.named_parameters() if n.startswith(prefix))


def poison(grad):
    """``grad`` with an inf in its first element: DeepSpeed finds the step's gradient norm invalid and skips it."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def activations_estimate(args) -> int:
    """The planner's activation estimate for this model and micro-batch (not in the plan's device total, whose
    budget leaves activations out), to set the measured peak against."""
    from ds_pseudo_real.offload.planner import estimate_activation_bytes

    return estimate_activation_bytes(args.micro_batch, args.seq_len, args.d_model, args.heads, args.layers,
                                     dtype(args), bool(args.checkpoint_activations))


def report(results: List[Dict], skip_step: Optional[int] = None) -> Dict:
    by_arm = {r["arm"]: r for r in results if "error" not in r}
    summary: Dict[str, Optional[object]] = {}
    if skip_step is not None:
        summary["skipped_steps"] = {arm: r["skipped_steps"] for arm, r in by_arm.items()}
        summary["skip_step_skipped_by_every_arm"] = all(r["skipped_steps"] == 1 for r in by_arm.values())
    if "none" in by_arm and "granular" in by_arm:
        # bit-equal on CPU, where both arms run the same Adam kernel; on CUDA "none" runs DeepSpeed's fused Adam
        summary["granular_losses_equal_none"] = by_arm["granular"]["losses"] == by_arm["none"]["losses"]
        summary["max_abs_loss_difference_granular_none"] = max(
            abs(a - b) for a, b in zip(by_arm["granular"]["losses"], by_arm["none"]["losses"]))
    granular = by_arm.get("granular")
    if granular:
        summary["accounting_equal_plan"] = all(
            granular["plan"]["measured"][k] == granular["plan"]["predicted"][k]
            for k in ("optimizer_device", "optimizer_host", "moved_per_step"))
        if granular["peak_device_bytes"]:
            predicted = granular["plan"]["predicted"]
            summary["peak_device_over_plan_with_activations"] = granular["peak_device_bytes"] / (
                predicted["device_total"] + predicted["activations_estimate"])
        # every arm's step time against granular's, side by side (> 1: that arm is slower)
        summary["step_time_over_granular"] = {arm: r["step_s_median"] / granular["step_s_median"]
                                              for arm, r in by_arm.items()}
        for other in ("none", "zero2_offload", "zero3_ratio"):
            if other in by_arm:
                summary[f"step_time_granular_over_{other}"] = granular["step_s_median"] / by_arm[other]["step_s_median"]
                if granular["peak_device_bytes"] and by_arm[other]["peak_device_bytes"]:
                    summary[f"peak_memory_granular_over_{other}"] = (granular["peak_device_bytes"]
                                                                     / by_arm[other]["peak_device_bytes"])
    return summary


def check_failures(results: List[Dict], summary: Dict, args: argparse.Namespace, cuda: bool) -> List[str]:
    """What ``--check`` fails on, in words (empty: the run passes)."""
    failures = [f"arm {r['arm']}: {r['error']}" for r in results if "error" in r]
    if summary.get("accounting_equal_plan") is False:
        failures.append("the granular optimizer's held or moved bytes differ from the plan's")
    if summary.get("skip_step_skipped_by_every_arm") is False:
        failures.append(f"the inf gradient of step {args.skip_step} was not skipped by every arm: "
                        f"{summary['skipped_steps']}")
    if "max_abs_loss_difference_granular_none" in summary:
        difference = summary["max_abs_loss_difference_granular_none"]
        loss = max(abs(x) for r in results if r.get("arm") == "none" for x in r["losses"])
        rounds_apart = cuda or (dtype(args) != "fp32" and args.gradient_accumulation > 1)
        allowed = LOSS_TOLERANCE[dtype(args)] * loss if rounds_apart else 0.0
        if difference > allowed:
            failures.append(f"granular losses differ from no offload's by {difference:.3g} (allowed {allowed:.3g})")
    return failures


def run_isolated(arm: str, argv: List[str]) -> Dict:
    """One arm per process: a ZeRO-3 engine leaves the process changed (after one, a plain ZeRO-2 run's losses
    moved in the last bit), and peak memory must not carry over from an earlier arm."""
    proc = subprocess.run([sys.executable, __file__, *argv, "--one-arm", arm], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    if proc.returncode != 0 or not lines:
        return {"arm": arm, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1][len("ARM "):])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one_arm:
        init_single_process(threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
        print("ARM " + json.dumps(run_arm(args.one_arm, args)), flush=True)
        return 0
    arms = ARMS if args.arms == "all" else tuple(args.arms.split(","))
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: got {unknown}; accepted: {list(ARMS)} or 'all'")
    results = [run_isolated(arm, argv) for arm in arms]
    summary = report(results, args.skip_step)
    rows = [[r["arm"], r.get("error") or f"{r['step_s_median'] * 1000:.1f}",
             "-" if not r.get("peak_device_bytes") else f"{r['peak_device_bytes'] / 2**20:.1f}",
             "-" if "losses" not in r else f"{r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}"] for r in results]
    print(markdown_table(["arm", "step ms (median)", "peak device MiB", "loss first -> last"], rows))
    for r in results:
        if "plan" in r:
            print(r["plan"]["table"])
            print(f"predicted {r['plan']['predicted']}\nmeasured  {r['plan']['measured']}")
            if r["peak_device_bytes"]:
                predicted = r["plan"]["predicted"]
                print(f"peak device {r['peak_device_bytes'] / 2**20:.1f} MiB; plan "
                      f"{predicted['device_total'] / 2**20:.1f} MiB + activations estimated "
                      f"{predicted['activations_estimate'] / 2**20:.1f} MiB")
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    path = write_json(Path(args.out), {"machine": machine_description(), "args": vars(args), "results": results,
                                       "summary": summary})
    print(f"wrote {path}")
    if not args.check:
        return 0
    import torch

    failures = check_failures(results, summary, args, torch.cuda.is_available())
    print("check: " + ("; ".join(failures) if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
