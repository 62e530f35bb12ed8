"""``ds-pseudo-real plan``: print the granular offload plan for a DeepSpeed config, without building the model.

Owns: argument parsing and printing. The config is read once (``ds_pseudo_real.run_config``), with the flags in
place of its keys; the numbers come from ``planner`` (byte model) and ``config`` (section); the per-rank parameter
counts from the flags, else the config's ``"m6"`` architecture (``ds_pseudo_real.moe.architecture``: dense layer,
experts over ``m6.expert_parallel`` ranks, embeddings), else ``granular_offload.model``. After the plan, its step per
way of running the host step (``offload.step_time``), at the config's rates or those ``offload.calibrate`` measures,
and, given the node, whether its host memory holds its ranks' plans.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.models.families.m6 import M6Section
from ds_pseudo_real.offload.calibrate import Calibration, calibrate, default_ranks_per_node
from ds_pseudo_real.offload.config import ACCELERATORS, ModelSize, planned_placement, training_setup
from ds_pseudo_real.offload.planner import (
    GroupSize, OffloadPlan, PlanError, describe_plan, format_bytes, parse_bytes, place, uniform_groups,
)
from ds_pseudo_real.offload.step_time import (
    DEFAULT_DEVICE_FLOPS, NO_COMPUTE, Compute, NodeFit, describe_node_fit, describe_step_times, step_times,
)
from ds_pseudo_real.run_config import RunConfig, load_ds_config
from ds_pseudo_real.training_facts import BATCH_KEYS


def _byte_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def m6_model_size(section: M6Section, given: Optional[ModelSize]) -> ModelSize:
    """Per-rank parameter counts of the ``"m6"`` section's architecture, experts as groups of their own, spread
    over ``m6.expert_parallel`` ranks (1 when not given).

    ``given`` (``granular_offload.model`` beside it) must count the same parameters, experts within
    ``layer_params`` or apart; its ``shared_groups`` is kept.
    """
    from ds_pseudo_real.moe import architecture as m6

    try:
        arch = section.architecture()
    except (ValueError, TypeError) as error:
        raise ConfigError(f"invalid config:\n  {error}") from None
    expert_parallel = section.expert_parallel or 1
    if arch.num_experts % expert_parallel:
        raise ConfigError(f"invalid config:\n  m6.expert_parallel: got {expert_parallel!r}; it must divide the "
                          f"{arch.num_experts} experts")
    derived = ModelSize(num_layers=arch.num_layers, layer_params=m6.dense_parameters_per_layer(arch),
                        expert_params=m6.expert_parameters_per_layer(arch, expert_parallel),
                        expert_parallel=expert_parallel, other_params=m6.embedding_parameters(arch),
                        shared_groups=given.shared_groups if given else None)
    if given is not None and ((given.num_layers, given.layer_params + given.expert_params, given.other_params)
                              != (derived.num_layers, derived.layer_params + derived.expert_params,
                                  derived.other_params)):
        raise ConfigError(
            f"invalid config:\n  granular_offload.model: got {given.num_layers} layers of "
            f"{given.layer_params + given.expert_params} parameters and {given.other_params} others per rank; the m6 "
            f"section ({arch.name}, expert_parallel {expert_parallel}) has {derived.num_layers} layers of "
            f"{derived.layer_params + derived.expert_params} and {derived.other_params}; accepted: counts that agree, "
            f"or no model key")
    return derived


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-pseudo-real plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DeepSpeed JSON with a granular_offload section")
    parser.add_argument("--device-memory", type=_byte_arg,
                        help="device budget per rank, e.g. 32GB (1e9) or 32GiB (2**30); overrides the section's")
    parser.add_argument("--host-memory", type=_byte_arg,
                        help="host memory per rank, e.g. 200GiB; plans needing more are refused; overrides the "
                             "section's host_memory")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cuda",
                        help="what the run trains on: cuda (default) counts the reserve, pinned host pages, "
                             "stream pools and DeepSpeed's reduce bucket; cpu plans a CPU-only run")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (ZeRO partitions over them)")
    parser.add_argument("--gradient-accumulation", type=_positive_int,
                        help="micro-batches per optimizer step; replaces the config's train_batch_size, "
                             "train_micro_batch_size_per_gpu and gradient_accumulation_steps (default: derived from "
                             "them as DeepSpeed does, 1 when none is given)")
    parser.add_argument("--num-layers", type=int, help="overrides granular_offload.model.num_layers")
    parser.add_argument("--layer-params", type=int, help="parameters per layer per rank; overrides the section's")
    parser.add_argument("--other-params", type=int, help="non-layer parameters per rank; overrides the section's")
    parser.add_argument("--shared-groups", type=int,
                        help="plan the pseudo model whose layers share this many parameter sets")
    parser.add_argument("--expert-params", type=int, help="MoE expert parameters per layer per rank")
    parser.add_argument("--expert-parallel", type=int, help="ranks the experts are spread over")
    step = parser.add_argument_group("step time and node (docs/offload.md, \"The step-time model\")")
    step.add_argument("--gpu-tflops", type=_positive_float, default=DEFAULT_DEVICE_FLOPS / 1e12,
                      help="device FLOP/s achieved per rank, in TFLOPS, for the modelled compute (default %(default)g: "
                           "a V100's 125 TFLOPS fp16 tensor-core peak at 25 %%)")
    step.add_argument("--calibrate", action="store_true",
                      help="measure this machine (DeepSpeed's CPU Adam on the cores one rank gets, pinned PCIe "
                           "copies on a GPU, the node's memory and cores) and model the step with what it measures")
    step.add_argument("--calibration", metavar="FILE", help="model with what an earlier --calibrate wrote to FILE")
    step.add_argument("--calibration-out", metavar="FILE", help="write what --calibrate measures to FILE (JSON)")
    step.add_argument("--ranks-per-node", type=_positive_int,
                      help="ranks on one node: --calibrate gives each rank the node's cores / this threads "
                           "(default: the node's GPUs, 1 without); with the node's memory, says whether their plans "
                           "fit it")
    step.add_argument("--host-memory-per-node", type=_byte_arg,
                      help="the node's memory, e.g. 512GiB (default: measured by --calibrate)")
    return parser


def read_calibration(args: argparse.Namespace) -> Optional[Calibration]:
    """The rates to model with: measured now (``--calibrate``, saved with ``--calibration-out``), read from
    ``--calibration``, or None (the config's)."""
    if args.calibrate and args.calibration:
        raise ConfigError(f"--calibration: got {args.calibration!r} with --calibrate; accepted: one of the two")
    if args.calibration_out and not args.calibrate:
        raise ConfigError(f"--calibration-out: got {args.calibration_out!r} without --calibrate, which it saves; "
                          f"accepted: with --calibrate")
    if args.host_memory_per_node is not None and args.ranks_per_node is None:
        raise ConfigError("--host-memory-per-node: the node check needs --ranks-per-node too")
    if args.ranks_per_node is not None and args.host_memory_per_node is None and not (
            args.calibrate or args.calibration):
        raise ConfigError(f"--ranks-per-node: got {args.ranks_per_node}; the node check needs the node's memory: "
                          f"--host-memory-per-node, --calibrate or --calibration")
    if args.calibration:
        try:
            return Calibration.load(args.calibration)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if not args.calibrate:
        return None
    calibration = calibrate(args.ranks_per_node or default_ranks_per_node())
    if args.calibration_out:
        calibration.save(args.calibration_out)
        print(f"wrote {args.calibration_out}", file=sys.stderr)
    return calibration


def read_ds_config(args: argparse.Namespace, calibration: Optional[Calibration]) -> dict:
    """The DeepSpeed config with the flags, and the measured rates, in place of its keys."""
    ds_config = load_ds_config(args.config)
    if args.device_memory is not None:
        ds_config.setdefault("granular_offload", {})
        ds_config["granular_offload"].pop("levels", None)
        ds_config["granular_offload"]["device_memory"] = args.device_memory
    if args.host_memory is not None:
        ds_config.setdefault("granular_offload", {})["host_memory"] = args.host_memory
    if args.gradient_accumulation is not None:
        for key in BATCH_KEYS:
            ds_config.pop(key, None)
        ds_config["gradient_accumulation_steps"] = args.gradient_accumulation
    if calibration is not None and isinstance(ds_config.get("granular_offload"), dict):
        ds_config["granular_offload"]["cpu_adam_params_per_s"] = calibration.cpu_adam_params_per_s
        if calibration.pcie_bytes_per_s is not None:
            ds_config["granular_offload"]["pcie_gb_per_s"] = calibration.pcie_bytes_per_s / 1e9
    return ds_config


def plan_groups(args: argparse.Namespace, config: RunConfig, section) -> Tuple[List[GroupSize], int]:
    """The rank's parameter groups and the model's layer count, from the flags, the m6 section or the model key."""
    model = section.model
    if isinstance(config.model, M6Section):
        model = m6_model_size(config.model, section.model)
        print(f"model: the m6 section ({model.num_layers} layers of {model.layer_params:,} dense + "
              f"{model.expert_params:,} expert parameters per rank, experts over {model.expert_parallel} ranks)")
    num_layers = args.num_layers or (model.num_layers if model else None)
    layer_params = args.layer_params or (model.layer_params if model else None)
    if num_layers is None or layer_params is None:
        raise ConfigError("invalid config:\n  granular_offload.model: needed to plan without building the model "
                          "(num_layers, layer_params[, other_params, shared_groups]), an m6 section, or give "
                          "--num-layers and --layer-params")
    other = args.other_params if args.other_params is not None else (model.other_params if model else 0)
    shared = args.shared_groups or (model.shared_groups if model else None)
    if shared is not None and (shared < 1 or num_layers % shared):
        raise ConfigError(f"invalid config:\n  --shared-groups: got {shared}; it must be >= 1 and divide "
                          f"num_layers ({num_layers})")
    experts = args.expert_params if args.expert_params is not None else (model.expert_params if model else 0)
    expert_parallel = args.expert_parallel or (model.expert_parallel if model else 1)
    if expert_parallel < 1 or args.world_size % expert_parallel:
        raise ConfigError(f"invalid config:\n  expert_parallel: got {expert_parallel}; it must divide the "
                          f"world size ({args.world_size})")
    groups = uniform_groups(num_layers, layer_params, other, shared, experts, args.world_size // expert_parallel)
    return groups, num_layers


def device_compute(config: RunConfig, section, groups: List[GroupSize], flops_per_s: float) -> Compute:
    """A micro-batch's work on the device: its tokens from ``granular_offload.activations``, else the m6 section's
    sequence x the micro-batch; the parameters a token meets from the m6 architecture (an expert per prototype),
    else every parameter of the rank's groups, as often as layers use it. None of these: no compute modelled."""
    m6 = config.model if isinstance(config.model, M6Section) else None
    if section.activations is not None:
        a = section.activations
        tokens, recompute = a.micro_batch * a.seq_len, a.checkpointing
    elif m6 is not None:
        tokens = m6.architecture().seq_length * config.training.micro_batch
        recompute = m6.checkpoint_activations
    else:
        return NO_COMPUTE
    if m6 is not None:
        from ds_pseudo_real.moe.architecture import active_parameters_per_token

        active = active_parameters_per_token(m6.architecture())
    else:
        active = sum(g.numel * g.uses for g in groups)
    return Compute(active, tokens, flops_per_s, recompute)


def print_step_and_node(plan: OffloadPlan, compute: Compute, args: argparse.Namespace,
                        calibration: Optional[Calibration]) -> None:
    """The modelled step per mode, saying which rates are measured, and the node check when the node is known."""
    measured = f"measured on {calibration.host}" if calibration else ""
    sources = {
        "host_adam": (f"{measured}, {calibration.cpu_adam_threads} threads" if calibration
                      else "assumed: granular_offload.cpu_adam_params_per_s"),
        "pcie": (f"{measured}, {calibration.device}" if calibration and calibration.pcie_bytes_per_s
                 else "assumed: granular_offload.pcie_gb_per_s"),
        "device": "assumed: --gpu-tflops",
    }
    print(describe_step_times(step_times(plan, compute), plan, compute, sources))
    memory = args.host_memory_per_node or (calibration.node_memory_bytes if calibration else None)
    ranks = args.ranks_per_node or (calibration.ranks_per_node if calibration else None)
    if memory is not None:
        name = "node" if args.host_memory_per_node else f"node ({measured}: {calibration.node_cores} cores)"
        print(describe_node_fit(NodeFit(ranks, plan.host_allocated_bytes, memory), name))


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        calibration = read_calibration(args)
        config = RunConfig.load(read_ds_config(args, calibration), world_size=args.world_size)
        section = config.granular_offload
        if section is None:
            raise ConfigError(f"{args.config}: no enabled granular_offload section and no --device-memory given")
        groups, num_layers = plan_groups(args, config, section)
        setup = training_setup(section, config.training, num_layers, args.accelerator)
        resident = place(groups, {}, setup, section.device_memory)
        print(f"without offload: device {format_bytes(resident.device_bytes)} per rank"
              + ("" if section.device_memory is None else
                 f" ({'fits' if resident.fits() else 'does not fit'} {format_bytes(section.device_memory)})"))
        try:
            plan = planned_placement(section, groups, setup)
        except PlanError as error:
            if error.plan is not None:
                furthest = "placement" if section.levels is not None else "furthest placement"
                print(f"{furthest} (does not fit):\n{describe_plan(error.plan)}")
            raise
        print(describe_plan(plan))
        print_step_and_node(plan, device_compute(config, section, groups, args.gpu_tflops * 1e12), args, calibration)
        return 0
    except (ConfigError, PlanError) as error:
        print(f"ds-pseudo-real plan: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
