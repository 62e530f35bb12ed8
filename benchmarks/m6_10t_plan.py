"""Does M6-10T fit? Its parameter counts (built on the meta device) and the per-GPU memory on 512 x 32 GB for the
pseudo and the real model, per ZeRO choice and expert-parallel layout, without and with granular offload.

The architecture is ``ds_pseudo_real.moe.architecture.M6_10T`` (48 layers, hidden 1024, 10,240 experts of FFN 9984
in 80 prototypes; vocabulary and sequence length are choices), the byte model and the placement are the offload
planner's (``ds_pseudo_real.offload.planner``). Per GPU: each layer owns its experts / EP plus its dense part
(attention, norms, router), which is counted on every GPU and partitioned by ZeRO only over the D = world / EP
ranks that hold the same experts (conservative for the dense part: 14.7M of a layer's 424M per GPU at EP 512).
Groups are those the offload optimizer builds for a DeepSpeed MoE model: each layer's dense part and its experts
apart. At host_params under ZeRO 1/2 a layer's gradients are streamed off the device; under ZeRO 1/2 one layer's
experts stay in DeepSpeed's optimizer (it needs an MoE group). V100s have no bf16: "bf16" stands for 16-bit
weights (fp16 costs the same bytes in the byte model; configs/m6_10t_v100.json plans it in fp16:
benchmarks/results/m6_10t_v100_plan.txt).

Each plan's step is modelled per mode (``ds_pseudo_real.offload.step_time``: sequential, overlapped, delayed) at the
config defaults' rates (5e8 host Adam params/s, 12 GB/s PCIe; or those a ``ds-pseudo-real plan --calibrate
--calibration-out FILE`` measured, with ``--calibration FILE``) and an assumed device rate, and its host memory is
checked against two example nodes (NODES: a DGX-1 and a DGX-2).

    python benchmarks/m6_10t_plan.py           # a few seconds; writes benchmarks/results/m6_10t_plan.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, markdown_table, write_json  # noqa: E402

SETUPS = (("bf16", 1), ("bf16", 2), ("fp32", 0))  # (working dtype, ZeRO stage) the planner models
# Example nodes: (name, GPUs, host memory, cores): NVIDIA's DGX-1 (8 V100, 512 GiB, 2 x 20 cores) and DGX-2
# (16 V100, 1.5 TiB, 2 x 24 cores)
NODES = (("DGX-1", 8, 512 * 2**30, 40), ("DGX-2", 16, 1536 * 2**30, 48))


def meta_counts(arch, groups: Optional[int]) -> int:
    from ds_pseudo_real.moe.architecture import build_meta_model
    from ds_pseudo_real.sharing import parameter_count

    return parameter_count(build_meta_model(arch, groups))


def plan_row(arch, stage: str, expert_parallel: int, world: int, dtype: str, zero: int, budget: int, reserved: int,
             micro_batch: int, rates: Optional[Dict] = None) -> Dict:
    if rates is None:  # the config defaults' rates and the plan command's device rate, all assumed
        from ds_pseudo_real.offload.step_time import DEFAULT_DEVICE_FLOPS

        rates = read_rates(argparse.Namespace(gpu_tflops=DEFAULT_DEVICE_FLOPS / 1e12, calibration=None))
    from ds_pseudo_real.moe.architecture import (
        dense_parameters_per_layer, embedding_parameters, expert_parameters_per_layer,
    )
    from ds_pseudo_real.offload.config import GranularOffloadConfig, training_setup
    from ds_pseudo_real.training_facts import TrainingFacts
    from ds_pseudo_real.offload.planner import (
        PlacementLevel, PlanError, estimate_activation_bytes, place, plan_placement, uniform_groups,
    )

    dp = world // expert_parallel
    # as the offload optimizer groups a DeepSpeed MoE model: each layer's dense part, then its experts
    groups = uniform_groups(arch.num_layers, dense_parameters_per_layer(arch), embedding_parameters(arch),
                            1 if stage == "pseudo" else None, expert_parameters_per_layer(arch, expert_parallel), dp)
    activation = estimate_activation_bytes(micro_batch, arch.seq_length, arch.hidden_size, arch.num_heads,
                                           arch.num_layers, dtype, checkpointing=True)
    # on CUDA with DeepSpeed's defaults: its reduce bucket, the offload's stream pools, pinned host buffers
    ds_config = {"zero_optimization": {"stage": zero}, "bf16": {"enabled": dtype == "bf16"}}
    section = GranularOffloadConfig(device_memory=budget, activation_bytes=activation, reserved=reserved,
                                    pcie_gb_per_s=rates["pcie_bytes_per_s"] / 1e9,
                                    cpu_adam_params_per_s=rates["cpu_adam_params_per_s"])
    setup = training_setup(section, TrainingFacts.from_deepspeed(ds_config, dp), arch.num_layers, accelerator="cuda")
    resident = place(groups, {}, setup, budget)
    row = {
        "stage": stage, "expert_parallel": expert_parallel, "data_parallel": dp, "dtype": dtype, "zero_stage": zero,
        "parameters_per_gpu": sum(g.numel for g in groups), "activation_bytes": activation,
        "resident_device_bytes": resident.device_bytes, "fits_without_offload": resident.fits(),
    }
    try:
        plan = resident if resident.fits() else plan_placement(groups, setup, budget, PlacementLevel.HOST_PARAMS)
    except PlanError as error:
        # the furthest placement the planner allows, to say how far from the budget it is
        plan = error.plan
        row.update(error=str(error))
    row.update(granular_fits=plan.fits(), **plan_figures(plan, arch, micro_batch, rates["flops_per_s"]))
    return row


def plan_figures(plan, arch, micro_batch: int, flops_per_s: float) -> Dict:
    from ds_pseudo_real.moe.architecture import active_parameters_per_token
    from ds_pseudo_real.offload.planner import PlacementLevel
    from ds_pseudo_real.offload.step_time import Compute, NodeFit, step_times

    # full activation checkpointing: the backward recomputes the forward
    compute = Compute(active_parameters_per_token(arch), micro_batch * arch.seq_length, flops_per_s, recompute=True)
    times = step_times(plan, compute)
    nodes = {}
    for name, gpus, memory, cores in NODES:
        fit = NodeFit(gpus, plan.host_allocated_bytes, memory)
        nodes[name] = dict(ranks=gpus, memory_bytes=memory, cores=cores, needed_bytes=fit.needed(), fits=fit.fits,
                           most_ranks=fit.most_ranks)
    return dict(step_seconds=dict(times._asdict(), overlapped_ratio=times.overlapped_ratio), nodes=nodes,
        levels={lvl.value: sum(p.level is lvl for p in plan.placements) for lvl in PlacementLevel},
        device_bytes=plan.device_bytes, host_bytes=plan.host_bytes, host_allocated_bytes=plan.host_allocated_bytes,
        moved_bytes_per_step=plan.moved_bytes_per_step, transfer_seconds=plan.transfer_seconds,
        host_adam_seconds=plan.host_adam_seconds, offload_seconds_per_step=plan.offload_seconds_per_step,
    )


def gb(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:,.1f}"


def read_rates(args) -> Dict:
    """The step-time model's rates: the config defaults' (assumed) or those in ``--calibration``, and the device's."""
    from dataclasses import asdict

    from ds_pseudo_real.offload.calibrate import Calibration
    from ds_pseudo_real.offload.planner import DEFAULT_CPU_ADAM_PARAMS_PER_S, DEFAULT_PCIE_BYTES_PER_S

    rates = {"cpu_adam_params_per_s": DEFAULT_CPU_ADAM_PARAMS_PER_S, "pcie_bytes_per_s": DEFAULT_PCIE_BYTES_PER_S,
             "flops_per_s": args.gpu_tflops * 1e12, "measured": []}
    if args.calibration:
        measured = Calibration.load(args.calibration)
        rates.update(cpu_adam_params_per_s=measured.cpu_adam_params_per_s, measured=["cpu_adam_params_per_s"],
                     calibration=asdict(measured))
        if measured.pcie_bytes_per_s is not None:
            rates.update(pcie_bytes_per_s=measured.pcie_bytes_per_s, measured=rates["measured"] + ["pcie_bytes_per_s"])
    return rates


def table_of(rows: List[Dict], gpus_per_node: int) -> str:
    header = ["stage", "EP x D", "dtype, ZeRO", "params/GPU", "all on GPU GiB", "fits 32 GiB",
              "granular: GPU GiB", "host GiB/GPU (pinned)", "host GiB/node", "moved GiB/step", "offload s/step",
              "step s: sequential / overlapped / delayed", "overlapped / sequential",
              *(f"{name}: ranks that fit / {gpus}" for name, gpus, _, _ in NODES), "levels"]
    table_rows = []
    for r in rows:
        levels = ", ".join(f"{k} {v}" for k, v in r["levels"].items() if v)
        step = r["step_seconds"]
        table_rows.append([
            r["stage"], f"{r['expert_parallel']} x {r['data_parallel']}", f"{r['dtype']}, {r['zero_stage']}",
            f"{r['parameters_per_gpu'] / 1e9:.2f}B", gb(r["resident_device_bytes"]),
            "yes" if r["fits_without_offload"] else "no",
            gb(r["device_bytes"]) + ("" if r["granular_fits"] else " (no plan fits)"),
            gb(r["host_allocated_bytes"]), gb(r["host_allocated_bytes"] * gpus_per_node),
            gb(r["moved_bytes_per_step"]), f"{r['offload_seconds_per_step']:.1f}",
            f"{step['sequential']:.1f} / {step['overlapped']:.1f} / {step['delayed']:.1f}",
            f"{step['overlapped_ratio']:.2f}",
            *(("all " if n["fits"] else "") + str(min(n["most_ranks"], n["ranks"])) for n in r["nodes"].values()),
            levels,
        ])
    return markdown_table(header, table_rows)


def main(argv=None) -> int:
    from ds_pseudo_real.offload.step_time import DEFAULT_DEVICE_FLOPS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=512, help="GPUs")
    p.add_argument("--gpu-memory-gib", type=float, default=32.0)
    p.add_argument("--reserved-gib", type=float, default=2.0, help="kept free per GPU (allocator, buffers)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--expert-parallel", type=int, nargs="+", default=[512, 64])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--gpu-tflops", type=float, default=DEFAULT_DEVICE_FLOPS / 1e12,
                   help="device FLOP/s achieved per GPU (default: a V100's 125 TFLOPS fp16 peak at 25 %%)")
    p.add_argument("--calibration", help="model with the rates a ds-pseudo-real plan --calibrate wrote here")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    from ds_pseudo_real.moe.architecture import M6_10T, total_parameters

    arch, rates = M6_10T, read_rates(args)
    counts = {
        "real_meta": meta_counts(arch, None), "pseudo_meta": meta_counts(arch, 1),
        "real_arithmetic": total_parameters(arch), "pseudo_arithmetic": total_parameters(arch, 1),
        "expert_parameters": arch.num_layers * arch.num_experts * 2 * arch.hidden_size * arch.expert_ffn_size,
    }
    budget = int(args.gpu_memory_gib * 2**30)
    reserved = int(args.reserved_gib * 2**30)
    rows: List[Dict] = []
    for stage in ("pseudo", "real"):
        for ep in args.expert_parallel:
            for dtype, zero in SETUPS:
                rows.append(plan_row(arch, stage, ep, args.world, dtype, zero, budget, reserved, args.micro_batch,
                                     rates))
    print(f"M6-10T ({arch}):\n  real model {counts['real_meta']:,} parameters (meta device; arithmetic "
          f"{counts['real_arithmetic']:,}; experts {counts['expert_parameters']:,})\n  pseudo model (one shared layer) "
          f"{counts['pseudo_meta']:,} parameters; real / pseudo = {counts['real_meta'] / counts['pseudo_meta']:.1f}")
    table = table_of(rows, args.gpus_per_node)
    said = {key: "measured" if key in rates["measured"] else "assumed" for key in ("cpu_adam_params_per_s",
                                                                                  "pcie_bytes_per_s")}
    print(f"\nper GPU on {args.world} x {args.gpu_memory_gib:g} GiB ({args.reserved_gib:g} GiB reserved, activations "
          f"with full checkpointing, micro-batch {args.micro_batch}, seq {arch.seq_length}; host buffers pinned at "
          f"their size, in whole pages; offload time at {rates['pcie_bytes_per_s'] / 1e9:.3g} GB/s PCIe "
          f"({said['pcie_bytes_per_s']}) and {rates['cpu_adam_params_per_s']:.3g} host Adam params/s "
          f"({said['cpu_adam_params_per_s']}), compute at {args.gpu_tflops:g} TFLOPS (assumed); nodes: "
          + ", ".join(f"{n} {g} GPUs, {m / 2**30:g} GiB, {c} cores" for n, g, m, c in NODES) + f"):\n{table}")
    path = write_json(args.out / "m6_10t_plan.json", {
        "architecture": vars(arch) if hasattr(arch, "__dict__") else str(arch), "parameters": counts,
        "world": args.world, "gpu_memory_bytes": budget, "reserved_bytes": reserved, "rates": rates,
        "nodes": [dict(zip(("name", "gpus", "memory_bytes", "cores"), node)) for node in NODES], "rows": rows,
        "table_markdown": table,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
