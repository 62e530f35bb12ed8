"""Overhead benchmark: what does the plugin cost when it does nothing, and what does one delink cost?

1. Step time of plain ``deepspeed.initialize`` vs ``ds_pseudo_real.initialize`` on the same model, same config,
   same batches, no transition and no offload; both engines live in one process and are timed interleaved (a block of
   steps of one, then the other, round after round), so machine noise falls on both. Two pairs: the real model
   (``pseudo_to_real.enabled: false``) and the pseudo model (layers tied, switch never reached) against plain
   DeepSpeed on the same tied model. The ratio is the median over rounds of plugin block time / plain block time.
2. One in-process delink of a model with ~1B real parameters (fp32, ZeRO 0, torch AdamW: fits 24 GiB) against one
   copy (clone) of the real model's parameters, measured in the same process.

    python benchmarks/overhead.py              # ~5 min on 2 CPU cores (the delink part needs ~14 GiB free)
    python benchmarks/overhead.py --quick      # ~1 min, a 0.1B delink

Writes benchmarks/results/overhead.json and prints the tables.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    RESULTS, cuda_sync, init_single_process, machine_description, markdown_table, median, write_json,
)


def ds_config(batch_size: int, ptr: Dict) -> Dict:
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10**6, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": 0},
        "pseudo_to_real": ptr,
    }


def build_pair(args, pseudo: bool):
    """(plain DeepSpeed engine, plugin controller) over identical models (tied for ``pseudo``)."""
    import deepspeed
    import torch

    import ds_pseudo_real
    from ds_pseudo_real.models import GPT, GPTConfig

    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head)
    ptr = {"enabled": pseudo, "layers": "layers", "switch": {"at_step": 10**9}}
    torch.manual_seed(0)
    plain_model = GPT(cfg)
    if pseudo:
        ds_pseudo_real.apply_sharing(plain_model, "layers", 1)
    config = ds_config(args.batch_size, ptr)
    plain_config = {k: v for k, v in config.items() if k != "pseudo_to_real"}
    plain, _, _, _ = deepspeed.initialize(model=plain_model, model_parameters=plain_model.parameters(),
                                          config=plain_config)
    torch.manual_seed(0)
    plugin, _, _, _ = ds_pseudo_real.initialize(model=GPT(cfg), config=config)
    return plain, plugin


def time_block(engine, batches) -> float:
    cuda_sync()
    start = time.perf_counter()
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    cuda_sync()
    return time.perf_counter() - start


def step_overhead(args, corpus, pseudo: bool) -> Dict:
    plain, plugin = build_pair(args, pseudo)
    batches = [tuple(t.to(plain.device) for t in corpus.batch("train", args.batch_size, args.seq_len, 0, i))
               for i in range(args.block)]
    for engine in (plain, plugin):  # warm-up, not timed
        time_block(engine, batches[:2])
    rounds: List[Dict[str, float]] = []
    for r in range(args.rounds):
        order = (plain, plugin) if r % 2 == 0 else (plugin, plain)  # alternate who goes first
        times = {("plain" if e is plain else "plugin"): time_block(e, batches) for e in order}
        rounds.append(times)
    ratios = [t["plugin"] / t["plain"] for t in rounds]
    # both engines saw the same batches and start from the same weights: their losses must agree
    x, y = batches[0]
    plain.eval(), plugin.eval()
    import torch

    with torch.no_grad():
        agree = float(plain(x, y)) - float(plugin(x, y))
    plain.destroy()
    plugin.engine.destroy()
    per_step = lambda key: median([t[key] for t in rounds]) / args.block  # noqa: E731
    return {
        "model": "pseudo (tied layers, switch never reached)" if pseudo else "real (pseudo_to_real.enabled false)",
        "rounds": args.rounds, "steps_per_block": args.block,
        "plain_step_s_median": per_step("plain"), "plugin_step_s_median": per_step("plugin"),
        "ratio_median": median(ratios), "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
        "ratio_min": min(ratios), "ratio_max": max(ratios), "within_3_percent": abs(median(ratios) - 1) <= 0.03,
        "val_loss_difference_after_training": agree, "block_times": rounds,
    }


def timed_clones(source, repeats: int, copies: int = 1):
    """Seconds, per repeat, to allocate and fill ``copies`` new copies of every tensor in ``source`` (on its
    device, an accelerator's work waited for), each repeat's copies freed before the next."""
    seconds = []
    for _ in range(repeats):
        cuda_sync()
        start = time.perf_counter()
        clones = [t.clone() for _ in range(copies) for t in source]
        cuda_sync()
        seconds.append(time.perf_counter() - start)
        del clones
        gc.collect()
    return seconds


def one_delink(args, cfg, corpus) -> Dict:
    """Build the pseudo model, train it one step (so there are Adam moments to carry), delink; the delink's
    seconds and report. Everything is released before returning."""
    import torch

    import ds_pseudo_real
    from ds_pseudo_real.stages import materialize
    from ds_pseudo_real.models import GPT

    # the pseudo model is built tied on the meta device and only its unique parameters get storage
    with torch.device("meta"):
        model = ds_pseudo_real.apply_sharing(GPT(cfg), "layers", 1)
    materialize(model, None)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                torch.nn.init.normal_(param, std=0.02)
            else:
                param.fill_(1.0 if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else 0.0)
    ptr = {"enabled": True, "layers": "layers", "switch": {"at_step": 10**9}, "optimizer_state": args.policy}
    engine, _, _, _ = ds_pseudo_real.initialize(model=model, config=ds_config(1, ptr))
    del model
    x, y = (t.to(engine.device) for t in corpus.batch("train", 1, args.big_seq_len, 0, 0))
    start = time.perf_counter()
    engine.backward(engine(x, y))
    engine.step()
    cuda_sync()
    pseudo_step = time.perf_counter() - start
    start = time.perf_counter()
    report = engine.delink()
    cuda_sync()
    delink_s = time.perf_counter() - start  # the report's seconds, and any device work still queued at its end
    engine.engine.destroy()
    del engine
    gc.collect()
    return {"delink_s": delink_s, "pseudo_step_s": pseudo_step, "report": report}


def delink_vs_copy(args, corpus) -> Dict:
    """Time, in one process, on the device the engine trains on: one clone of the real model's parameters (the
    same bytes, allocated and copied), three clones of them (the bytes a ZeRO-0 delink writes: the parameters and
    two Adam moments), and ``--delinks`` delinks of the pseudo model after one step, one after another. On a
    machine that backs new memory slowly, the first delink pays for memory the process never had; the later ones
    run on memory it has had, as the clones after the first do."""
    import torch

    from ds_pseudo_real.device import rank_device
    from ds_pseudo_real.models import GPT, GPTConfig

    cfg = GPTConfig(seq_len=args.big_seq_len, n_layer=args.big_layers, d_model=args.big_d_model,
                    n_head=args.big_d_model // 128)
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(cfg).parameters()]
    real_numel = sum(s.numel() for s in shapes)
    device = rank_device()
    source = [torch.ones(s, device=device) for s in shapes]
    copies = timed_clones(source, args.copy_repeats)
    stage_writes = timed_clones(source, args.copy_repeats, copies=3)
    del source
    gc.collect()
    runs = [one_delink(args, cfg, corpus) for _ in range(args.delinks)]
    report = runs[0]["report"]
    copy_s = median(copies)
    out = {
        "real_parameters": real_numel, "layers": args.big_layers, "d_model": args.big_d_model,
        "parameters_before": report["parameters_before"], "parameters_after": report["parameters_after"],
        "optimizer_state": report["optimizer_state"], "delink_s": runs[0]["delink_s"],
        "delink_report_s": report["seconds"], "copy_s_median": copy_s, "copy_s_all": copies, "device": str(device),
        "delink_over_copy": runs[0]["delink_s"] / copy_s, "pseudo_step_s": runs[0]["pseudo_step_s"],
        "memory_after_bytes": report["memory_after"], "phases": report["phases"],
        "three_copies_s_median": median(stage_writes), "three_copies_s_all": stage_writes,
        "delinks_s": [r["delink_s"] for r in runs], "delinks_phases": [r["report"]["phases"] for r in runs],
    }
    if len(runs) > 1:
        out["last_delink_over_copy"] = runs[-1]["delink_s"] / copy_s
        out["last_delink_over_three_copies"] = runs[-1]["delink_s"] / median(stage_writes)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and a 0.1B delink (~1 min)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 12, quick 4)")
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--big-layers", type=int, default=None, help="delink model layers (default 20, quick 8)")
    p.add_argument("--big-d-model", type=int, default=None, help="delink model hidden (default 2048: 1.0B real, quick 1024)")
    p.add_argument("--big-seq-len", type=int, default=8)
    p.add_argument("--policy", default="scale", choices=("copy", "scale", "reset"))
    p.add_argument("--copy-repeats", type=int, default=3)
    p.add_argument("--delinks", type=int, default=1,
                   help="delinks timed one after another in the process (the later ones on memory it has had)")
    p.add_argument("--skip-delink", action="store_true")
    p.add_argument("--delink-only", action="store_true",
                   help="only the delink against one copy (no step-overhead rounds) -> overhead_delink.json")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no OpenMP spinning on a shared machine)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 12)
    args.big_layers = args.big_layers or (8 if args.quick else 20)
    args.big_d_model = args.big_d_model or (1024 if args.quick else 2048)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    init_single_process(args.threads)
    from ds_pseudo_real.data import ByteCorpus

    corpus = ByteCorpus(max_bytes=1 << 20)
    started = time.perf_counter()
    result = {"machine": machine_description(), "args": vars(args) | {"out": str(args.out)}, "step_overhead": []}
    for pseudo in (False, True) if not args.delink_only else ():
        result["step_overhead"].append(step_overhead(args, corpus, pseudo))
    rows = [[r["model"], f"{r['plain_step_s_median'] * 1e3:.1f}", f"{r['plugin_step_s_median'] * 1e3:.1f}",
             f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
             "yes" if r["within_3_percent"] else "no"] for r in result["step_overhead"]]
    table = markdown_table(["model", "plain DeepSpeed ms/step", "plugin ms/step", "ratio median (min-max)",
                            "within 3%"], rows)
    print(table, flush=True)
    if not args.skip_delink:
        d = delink_vs_copy(args, corpus)
        result["delink"] = d
        delink_table = markdown_table(
            ["real params", "pseudo params", "policy", "delink", "delink s", "one copy of real params s",
             "delink / copy", "three copies s", "delink / three copies", "phases s"],
            [[f"{d['real_parameters']:,}", f"{d['parameters_before']:,}", d["optimizer_state"], f"{i + 1} of {len(d['delinks_s'])}",
              f"{seconds:.2f}", f"{d['copy_s_median']:.2f}", f"{seconds / d['copy_s_median']:.1f}",
              f"{d['three_copies_s_median']:.2f}", f"{seconds / d['three_copies_s_median']:.2f}",
              ", ".join(f"{k} {v:.2f}" for k, v in phases.items())]
             for i, (seconds, phases) in enumerate(zip(d["delinks_s"], d["delinks_phases"]))])
        print(delink_table, flush=True)
        table += "\n\n" + delink_table
    result["elapsed_s"] = time.perf_counter() - started
    result["table_markdown"] = table
    name = "overhead_delink" if args.delink_only else "overhead"
    path = write_json(args.out / f"{name}{'_quick' if args.quick else ''}.json", result)
    print(f"wrote {path} ({result['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
