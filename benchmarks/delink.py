"""The delink at scale: its time against one copy of the real parameters, its peak host memory against the rank's
real-stage bytes, and whether the pseudo engine is freed, for the dense GPT and the M6 MoE at 1 and 2 ranks and
ZeRO 1/2/3 (measured side by side in one run); plus the M6-10T figure from the byte model (no run).

Per rank, after one pseudo step:
- ``delink_over_copy``: the delink's seconds / the seconds of one clone of the real parameters this rank builds
  (fp32, the same shapes; tensors of at most 32 MiB come from pages the allocator kept, larger ones are freshly
  mapped, so for small models this is a warm copy);
- ``delink_over_touch``: the delink's seconds / the seconds of writing, once, fresh allocations of the bytes the
  delink brings into being (the rank's parameters, fp32 masters and optimizer state; median of 3): the traffic any
  build of the real stage pays, page faults included;
- ``phases``: the delink's own account of its seconds (``last_transition["phases"]``: gather, release, starts,
  model, engine, masters, carry);
- ``peak_host_over_real``: (peak RSS during the delink - the RSS of the process before any model existed) / the
  rank's real-stage bytes (parameters, gradients, fp32 master and optimizer state, DeepSpeed's own accounting; on a
  CPU run they all live on the host). The peak is the kernel's high-water mark, reset just before the delink;
- ``freed``: weak references to the pseudo engine and its optimizer are dead after the delink and ``gc.collect()``,
  and the module given to ``initialize`` is dead or holds no storage;
- ``model_bytes_per_parameter``: the RSS the built real model adds (measured around the stage builder's build of it,
  before ``deepspeed.initialize``) per real parameter this rank builds, and ``model_storage_per_parameter`` the
  bytes its parameter tensors hold (this rank's partitions under ZeRO-3): what every rank holds on the host for the
  model before DeepSpeed moves it to the device (4 in fp32, 2 in bf16 when it is built in the working dtype; the
  RSS figure is lower where the allocator reuses pages the pseudo engine freed);
- ``built_peak_over_real``: the part of ``peak_host_over_real`` reached by the time the new engine is built (before
  the moments are seeded and filled);
- ``peak_over_real_from_baseline``: the same peak over the process's own memory instead of the floor: (peak RSS -
  (RSS once the pseudo engine is released - the bytes of the gathered pseudo state)) / real-stage bytes. The floor
  charges the delink with what the process comes to hold whatever the model's size (libraries mapped and modules
  imported since, DeepSpeed's and gloo's buffers: about 240 MiB per rank here); this baseline does not, but it
  would also absorb memory the release failed to return, which ``freed`` and the floor-based figure still show.
A rank row reports the worst rank. A configuration DeepSpeed refuses (its MoE under ZeRO-3) is reported as such.

    python benchmarks/delink.py            # ~4 min on 2 CPU cores; writes benchmarks/results/delink.json
    python benchmarks/delink.py --quick    # smaller models, 1 and 2 ranks, ZeRO 1 and 3 only
    python benchmarks/delink.py --dtype bf16 --zero 1,2 --models dense --out benchmarks/results/delink_bf16.json
    python benchmarks/delink.py --size large --dtype bf16 --out benchmarks/results/delink_large_bf16.json
    python benchmarks/delink.py --size xl --models dense --zero 3 --worlds 2 --dtype bf16 --out ...
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, markdown_table, write_json  # noqa: E402

MODELS = {
    "dense": {"gpt": {"n_layer": 8, "d_model": 512, "n_head": 8, "seq_len": 16}},
    "moe": {"m6": {"preset": "m6-tiny", "num_layers": 4, "hidden_size": 256, "num_heads": 4, "expert_ffn_size": 512,
                   "seq_length": 16}},
}
QUICK = {
    "dense": {"gpt": {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 16}},
    "moe": {"m6": {"preset": "m6-tiny", "seq_length": 16}},
}
LARGE = {  # sizes where the per-byte costs outweigh the engine's fixed ones: 202M and 143M real parameters
    "dense": {"gpt": {"n_layer": 16, "d_model": 1024, "n_head": 8, "seq_len": 16}},
    "moe": {"m6": {"preset": "m6-tiny", "num_layers": 8, "hidden_size": 512, "num_heads": 4, "expert_ffn_size": 2048,
                   "seq_length": 16}},
}
XL = {  # twice the dense model of LARGE (404M real parameters): with LARGE, how the peak grows with the model
    "dense": {"gpt": {"n_layer": 32, "d_model": 1024, "n_head": 8, "seq_len": 16}},
}
SIZES = {"default": MODELS, "quick": QUICK, "large": LARGE, "xl": XL}


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS (Linux >= 4.0: ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(model: str, zero: int, policy: str, size: str, dtype: str = "fp32", granular: str = "") -> Dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_pseudo_real
    from ds_pseudo_real.models.build import build_model, model_spec, parameter_groups
    from ds_pseudo_real.run_config import RunConfig

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    floor = rss_bytes()
    section = json.loads(json.dumps(SIZES[size][model]))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": zero},
              "pseudo_to_real": {"layers": "layers", "switch": {"at_step": 10**9}, "optimizer_state": policy},
              **section}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    spec = model_spec(RunConfig.load(config, world_size=world), {}, vocab_size=256)
    if granular:  # every layer at this level, in both stages
        config["granular_offload"] = {"levels": [granular] * spec.num_layers}
    module = build_model(spec, seed=0)
    engine, _, _, _ = ds_pseudo_real.initialize(model=module, config=config, model_parameters=parameter_groups(spec))
    x = torch.randint(0, 256, (2, spec.seq_len), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x, x))
    engine.step()
    pseudo = weakref.ref(engine.engine)
    pseudo_optimizer = weakref.ref(engine.engine.optimizer)
    caller_module = weakref.ref(module)
    del module
    gc.collect()
    marks = measure_build()
    before = rss_bytes()
    peak_ok = reset_peak_rss()
    report = engine.delink()
    peak = rss_bytes("VmHWM") if peak_ok else None
    gc.collect()
    freed = {"engine": pseudo() is None, "optimizer": pseudo_optimizer() is None,
             "caller_module_released": caller_module() is None
             or sum(p.numel() for p in caller_module().parameters()) == 0}
    real_bytes = sum(report["memory_after"].values())
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in engine.module.parameters()]
    source = [torch.ones(s) for s in shapes]
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        clone = [t.clone() for t in source]
        copies.append(time.perf_counter() - start)
        del clone
        gc.collect()
    copy_s = sorted(copies)[1]
    del source
    gc.collect()
    # the bytes the delink brings into being (parameters, fp32 masters, optimizer state), each kind as one fresh
    # allocation written once: the memory traffic no build of the real stage can avoid
    # (median of 3: the first can land on memory the machine has never backed, as a VM backs it on first use)
    made = [report["memory_after"][kind] for kind in ("parameters", "fp32_master", "optimizer_state")]
    touches = []
    for _ in range(3):
        start = time.perf_counter()
        touched = [torch.empty(n, dtype=torch.uint8).fill_(1) for n in made if n]
        touches.append(time.perf_counter() - start)
        del touched
        gc.collect()
    touch_s = sorted(touches)[1]
    result = {
        "rank": rank, "world": world, "zero": zero, "model": model, "policy": policy, "dtype": dtype,
        "parameters_before": report["parameters_before"], "parameters_after": report["parameters_after"],
        "rank_real_parameters": sum(int(torch.Size(s).numel()) for s in shapes),
        "delink_s": report["seconds"], "copy_s": copy_s, "delink_over_copy": report["seconds"] / copy_s,
        "phases": report["phases"], "touch_s": touch_s, "delink_over_touch": report["seconds"] / touch_s,
        "rss_floor": floor, "rss_before_delink": before, "peak_rss_during_delink": peak,
        "real_stage_bytes": real_bytes, "memory_after": report["memory_after"],
        "peak_host_over_real": None if peak is None else (peak - floor) / real_bytes,
        "model_build_bytes": marks["model"],
        "model_bytes_per_parameter": marks["model"] / sum(int(torch.Size(s).numel()) for s in shapes),
        "model_storage_per_parameter": marks["storage"] / sum(int(torch.Size(s).numel()) for s in shapes),
        "built_peak_over_real": None if not peak_ok else (marks["built_peak"] - floor) / real_bytes,
        "gathered_bytes": marks.get("gathered", 0), "rss_after_release": marks["released"],
        "process_baseline": marks["released"] - marks.get("gathered", 0),
        "peak_over_real_from_baseline": None if peak is None else (
            peak - (marks["released"] - marks.get("gathered", 0))) / real_bytes,
        "freed": freed,
    }
    engine.engine.destroy()
    return result


def measure_build() -> Dict[str, int]:
    """Wrap the stage builder's model build (``materialize``, ZeRO-3's ``_materialize_partitioned``) and engine
    build (``_new_engine``) to record the RSS the built model adds and the RSS high-water mark once the engine is
    built; and the gather and release of the pseudo engine, to record the bytes gathered and the RSS once it is
    released."""
    from ds_pseudo_real import ds_state, stages
    from ds_pseudo_real.stages import StageBuilder

    marks: Dict[str, int] = {}

    def rss_added(function):
        def wrapper(*args, **kwargs):
            start = rss_bytes()
            out = function(*args, **kwargs)
            marks["model"] = rss_bytes() - start
            marks["storage"] = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in out.parameters())
            return out
        return wrapper

    def new_engine(self, *args, **kwargs):
        out = built(self, *args, **kwargs)
        marks["built_peak"] = rss_bytes("VmHWM")
        return out

    def gather_full_state(*args, **kwargs):
        weights, moments = gathered(*args, **kwargs)
        marks["gathered"] = sum(t.numel() * t.element_size() for t in [
            *weights.values(), *(t for per in moments.values() for t in per.values())])
        return weights, moments

    def release_engine(self, *args, **kwargs):
        out = release(self, *args, **kwargs)
        marks["released"] = rss_bytes()
        return out

    built, release = StageBuilder._new_engine, StageBuilder.release
    gathered = ds_state.gather_full_state
    ds_state.gather_full_state = gather_full_state
    StageBuilder.release = release_engine
    stages.materialize = rss_added(stages.materialize)
    StageBuilder._materialize_partitioned = rss_added(StageBuilder._materialize_partitioned)
    StageBuilder._new_engine = new_engine
    return marks


def free_port() -> int:
    from ds_pseudo_real.ports import rendezvous_port

    return rendezvous_port()


def run_case(model: str, world: int, zero: int, policy: str, size: str, timeout: float, dtype: str = "fp32",
             no_trim: bool = False, granular: str = "") -> Dict:
    """One configuration on ``world`` gloo ranks (torchrun); the worst rank's figures."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), __file__, "--worker", model, str(zero), policy, "--dtype", dtype, "--size", size] + (
               ["--no-trim"] if no_trim else []) + (["--granular", granular] if granular else [])
    case = {"model": model, "world": world, "zero": zero, "policy": policy, "dtype": dtype,
            **({"granular": granular} if granular else {})}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timed out after {timeout:.0f} s"}
    ranks = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(ranks) != world:
        lines = [line.split("]: ", 1)[-1] for line in (proc.stderr + proc.stdout).splitlines()
                 if line.startswith("[rank") and "Error: " in line]
        return {**case, "error": (lines[0] if lines else f"exit status {proc.returncode}")[:300]}
    worst = lambda key: max(r[key] for r in ranks if r[key] is not None) if any(  # noqa: E731
        r[key] is not None for r in ranks) else None
    return {**case, "parameters_before": ranks[0]["parameters_before"],
            "parameters_after": ranks[0]["parameters_after"],
            "delink_s": max(r["delink_s"] for r in ranks), "copy_s": max(r["copy_s"] for r in ranks),
            "delink_over_copy": worst("delink_over_copy"), "peak_host_over_real": worst("peak_host_over_real"),
            "touch_s": max(r["touch_s"] for r in ranks), "delink_over_touch": worst("delink_over_touch"),
            "phases": max((r for r in ranks), key=lambda r: r["delink_s"])["phases"],
            "model_bytes_per_parameter": worst("model_bytes_per_parameter"),
            "model_storage_per_parameter": worst("model_storage_per_parameter"),
            "built_peak_over_real": worst("built_peak_over_real"),
            "peak_over_real_from_baseline": worst("peak_over_real_from_baseline"),
            "freed": all(all(r["freed"].values()) for r in ranks), "ranks": ranks}


def m6_10t_plan_only(world: int = 512, expert_parallel: int = 512, ranks_per_node: int = 8,
                     gpu_memory_gib: float = 32.0, reserved_gib: float = 2.0) -> Dict:
    """Host bytes per rank the delink needs for M6-10T at ``world`` GPUs of ``gpu_memory_gib``, from the parameter
    counts and the planner's byte model (no run). Every rank gathers its pseudo model's full fp32 weights and both
    Adam moments (12 bytes per pseudo parameter: its experts, the shared layer, the embedding). The real stage does
    not fit on the GPUs, so it trains through granular offload (bf16, ZeRO 1: the planner's placement), and the
    delink keeps the gathered state on the host (``stages.GATHERED_ON``) beside the real stage's host state
    it builds. The real model it builds: in fp32 on the host (the first delink), in the working dtype bf16 on the
    host (2 bytes per real parameter), or, as now, where it trains (``ds_pseudo_real.device.rank_device``; the
    host_params layers in their host allocations, counted in the real stage's host bytes). The goal: the real
    stage's host bytes x 1.2 plus one layer (one fp32 layer)."""
    from benchmarks.m6_10t_plan import plan_row
    from ds_pseudo_real.moe.architecture import M6_10T, embedding_parameters, layer_parameters

    layer = layer_parameters(M6_10T, expert_parallel)
    real = embedding_parameters(M6_10T) + M6_10T.num_layers * layer
    pseudo = embedding_parameters(M6_10T) + layer
    gathered = 3 * 4 * pseudo
    stage = plan_row(M6_10T, "real", expert_parallel, world, "bf16", 1, int(gpu_memory_gib * 2**30),
                     int(reserved_gib * 2**30), micro_batch=1)
    real_host = stage["host_allocated_bytes"]
    return {"world": world, "expert_parallel": expert_parallel, "rank_real_parameters": real,
            "rank_pseudo_parameters": pseudo, "layer_parameters_per_rank": layer,
            "host_bytes_per_rank_fp32_host_build": 4 * real + gathered,
            "host_bytes_per_rank_bf16_host_build": 2 * real + gathered,
            "host_bytes_per_rank_today": gathered, "host_bytes_per_node_today": gathered * ranks_per_node,
            "real_stage_levels": stage["levels"], "real_stage_host_bytes_per_rank": real_host,
            "peak_host_bytes_per_rank": real_host + gathered,
            "peak_host_over_real_stage_host": (real_host + gathered) / real_host,
            "goal_host_bytes_per_rank": 1.2 * real_host + 4 * layer,
            "one_fp32_layer_bytes": 4 * layer, "ranks_per_node": ranks_per_node}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "ZERO", "POLICY"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small models; ZeRO 1 and 3 only")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model sizes: default (25M dense, 9.5M MoE), quick (as --quick), large (202M dense, "
                             "143M MoE: about 8 GiB of host memory for the 2-rank ZeRO-1 MoE case), xl (404M dense "
                             "only, to see how the peak grows with the model: about 13 GiB for 2 ranks at ZeRO 3)")
    parser.add_argument("--policy", default="scale", choices=("copy", "scale", "reset"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the engine's working dtype")
    parser.add_argument("--zero", help="ZeRO stages, comma-separated (default 1,2,3; --quick 1,3)")
    parser.add_argument("--models", default="dense,moe", help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--no-trim", action="store_true",
                        help="keep freed host memory in the process (no malloc_trim in the delink): its effect")
    parser.add_argument("--worlds", default="1,2", help="rank counts, comma-separated")
    parser.add_argument("--granular", default="", choices=("", "host_optimizer", "host_params"),
                        help="train through granular offload with every layer at this level (in both stages)")
    parser.add_argument("--out", default=str(RESULTS / "delink.json"))
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.size is None:
        args.size = "quick" if args.quick else "default"
    if args.worker:
        model, zero, policy = args.worker
        if args.no_trim:
            from ds_pseudo_real import stages

            stages.return_freed_host_memory = lambda: None
        result = worker(model, int(zero), policy, args.size, args.dtype, args.granular)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    unknown = [m for m in args.models.split(",") if m not in SIZES[args.size]]
    if unknown:
        raise SystemExit(f"--models: {unknown} not in --size {args.size} (it has {', '.join(SIZES[args.size])})")
    cases = []
    stages = [int(z) for z in args.zero.split(",")] if args.zero else ((1, 3) if args.quick else (1, 2, 3))
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for zero in stages:
                case = run_case(model, world, zero, args.policy, args.size, args.timeout, args.dtype, args.no_trim,
                                args.granular)
                cases.append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "ranks"}), flush=True)
    plan = m6_10t_plan_only()
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    rows = [[c["model"], c["world"], c["zero"], f"{c['parameters_before']:,} -> {c['parameters_after']:,}",
             f"{c['delink_s']:.2f}", f"{c['copy_s']:.3f}", f"{c['delink_over_copy']:.1f}",
             f"{c['delink_over_touch']:.1f}", ", ".join(f"{k} {v:.2f}" for k, v in c["phases"].items()),
             "n/a" if c["peak_host_over_real"] is None else f"{c['peak_host_over_real']:.2f}",
             "n/a" if c["built_peak_over_real"] is None else f"{c['built_peak_over_real']:.2f}",
             "n/a" if c["peak_over_real_from_baseline"] is None else f"{c['peak_over_real_from_baseline']:.2f}",
             f"{c['model_bytes_per_parameter']:.2f} ({c['model_storage_per_parameter']:.2f})",
             "yes" if c["freed"] else "NO"] if "error" not in c else
            [c["model"], c["world"], c["zero"], "refused: " + c["error"], "", "", "", "", "", "", "", "", "", ""]
            for c in cases]
    table = markdown_table(["model", "ranks", "ZeRO", "parameters", "delink s", "one copy s", "delink / copy",
                            "delink / writing the real stage's bytes", "phases s",
                            "peak host / real-stage bytes", "of it when the engine is built",
                            "peak host over the process's own / real-stage bytes",
                            f"built model ({args.dtype}), RSS (storage) bytes / parameter", "pseudo engine freed"],
                           rows)
    table += (f"\n\nM6-10T at {plan['world']} GPUs, EP {plan['expert_parallel']} (byte model, no run): each rank "
              f"builds {plan['rank_real_parameters']:,} real parameters from {plan['rank_pseudo_parameters']:,} "
              f"pseudo ones. The real stage trains through granular offload ({plan['real_stage_levels']}) with "
              f"{gib(plan['real_stage_host_bytes_per_rank'])} of host memory per rank; the delink adds the gathered "
              f"fp32 pseudo weights and moments, {gib(plan['host_bytes_per_rank_today'])} "
              f"({gib(plan['host_bytes_per_node_today'])} per {plan['ranks_per_node']}-GPU node), with the real "
              f"model built where it trains: a peak of {gib(plan['peak_host_bytes_per_rank'])}, "
              f"{plan['peak_host_over_real_stage_host']:.3f}x the real stage's host bytes (goal: 1.2x plus one "
              f"fp32 layer, {gib(plan['goal_host_bytes_per_rank'])}). Building the real model on the host would "
              f"have added {gib(plan['host_bytes_per_rank_bf16_host_build'] - plan['host_bytes_per_rank_today'])} "
              f"in bf16, {gib(plan['host_bytes_per_rank_fp32_host_build'] - plan['host_bytes_per_rank_today'])} in "
              f"fp32. A job that does not offload keeps the gathered state on its devices.")
    print(table, flush=True)
    write_json(args.out, {"args": vars(args), "cases": cases, "m6_10t_plan_only": plan, "table_markdown": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
