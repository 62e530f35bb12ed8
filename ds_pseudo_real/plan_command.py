"""``ds-pseudo-real plan``: print the granular offload plan for a DeepSpeed config, without building the model.

Owns: argument parsing and printing. The config is read once (``ds_pseudo_real.run_config``), with the flags in
place of its keys; the numbers come from ``planner`` (byte model) and ``config`` (section); the per-rank parameter
counts from the flags, else the config's ``"m6"`` architecture (``ds_pseudo_real.moe.architecture``: dense layer,
experts over ``m6.expert_parallel`` ranks, embeddings), else ``granular_offload.model``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.models.families.m6 import M6Section
from ds_pseudo_real.offload.config import ACCELERATORS, ModelSize, planned_placement, training_setup
from ds_pseudo_real.offload.planner import PlanError, describe_plan, format_bytes, parse_bytes, place, uniform_groups
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
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ds_config = load_ds_config(args.config)  # the flags below replace its keys before it is read
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
        config = RunConfig.load(ds_config, world_size=args.world_size)
        section = config.granular_offload
        if section is None:
            raise ConfigError(f"{args.config}: no enabled granular_offload section and no --device-memory given")
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
        return 0
    except (ConfigError, PlanError) as error:
        print(f"ds-pseudo-real plan: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
