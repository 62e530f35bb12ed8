"""Checkpoint benchmark: what the plugin's verified, fsynced saves and the verification on load cost.

In one process, round after round on the same engine (so machine noise falls on every arm):
- save: plain DeepSpeed ``save_checkpoint`` vs the plugin's (each file checksummed as it is written and fsynced,
  the manifest added, atomic rename);
- load: ``checkpoint.verify`` checksum and size against DeepSpeed's own ``load_checkpoint`` of the same folder.
The page cache holds the files right after they were written, so the reads measure crc32 and torch.load, not a disk.

    python benchmarks/checkpoint.py               # a 0.1B-parameter GPT at ZeRO 1 (1.2 GiB per checkpoint), ~3 min
    python benchmarks/checkpoint.py --quick       # a small model, seconds

Writes benchmarks/results/checkpoint.json and prints the table.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    RESULTS, init_single_process, machine_description, markdown_table, median, write_json,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 layers of 128, 3 rounds")
    parser.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.rounds = 4, 128, 3
    init_single_process()
    import torch

    import ds_pseudo_real
    from ds_pseudo_real import checkpoint as ckpt
    from ds_pseudo_real import ds_state
    from ds_pseudo_real.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64), seq_len=32))
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = ds_pseudo_real.initialize(model=model, config=config)
    x = torch.randint(0, 256, (1, 32))
    engine.backward(engine(x, x))
    engine.step()  # the Adam moments exist

    times = {key: [] for key in ("plain_save", "plugin_save", "verify_checksum", "verify_size", "deepspeed_load",
                                 "state_fingerprint")}
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    try:
        for round_ in range(args.rounds):
            for folder in ("plain", "plugin"):
                shutil.rmtree(root / folder, ignore_errors=True)
            start = time.perf_counter()
            engine.engine.save_checkpoint(str(root / "plain"), tag="t")
            times["plain_save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.save_checkpoint(str(root / "plugin"), tag="t")
            times["plugin_save"].append(time.perf_counter() - start)
            for mode in ("checksum", "size"):
                verdict = ckpt.verify(str(root / "plugin"), "t", mode)
                assert verdict.ok, verdict.problems
                times[f"verify_{mode}"].append(verdict.seconds)
            start = time.perf_counter()
            engine.engine.load_checkpoint(str(root / "plugin"), "t")
            times["deepspeed_load"].append(time.perf_counter() - start)
            start = time.perf_counter()  # the plugin's check that the load restored the state: once at save, once here
            ds_state.state_fingerprint(engine.engine)
            times["state_fingerprint"].append(time.perf_counter() - start)
            print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()),
                  flush=True)
        nbytes = verdict.nbytes
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {key: median(values) for key, values in times.items()}
    result = {
        "machine": machine_description(),
        "model": {"layers": args.layers, "d_model": args.d_model, "zero_stage": 1,
                  "parameters": ds_pseudo_real.parameter_count(engine.module)},
        "checkpoint_bytes": nbytes,
        "rounds": args.rounds,
        "seconds": times,
        "median_seconds": med,
        "plugin_save_over_plain_save": med["plugin_save"] / med["plain_save"],
        "verify_checksum_over_load": med["verify_checksum"] / med["deepspeed_load"],
        "verify_size_over_load": med["verify_size"] / med["deepspeed_load"],
        "state_fingerprint_over_load": med["state_fingerprint"] / med["deepspeed_load"],
        "checksum_gib_per_s": nbytes / med["verify_checksum"] / 2**30,
    }
    write_json(Path(args.out), result)
    rows = [
        ["plugin save / plain DeepSpeed save", f"{result['plugin_save_over_plain_save']:.2f}",
         f"{med['plugin_save']:.2f} s / {med['plain_save']:.2f} s"],
        ["verify checksum / DeepSpeed load", f"{result['verify_checksum_over_load']:.3f}",
         f"{med['verify_checksum']:.3f} s / {med['deepspeed_load']:.2f} s ({result['checksum_gib_per_s']:.2f} GiB/s)"],
        ["verify size / DeepSpeed load", f"{result['verify_size_over_load']:.4f}",
         f"{med['verify_size']:.4f} s / {med['deepspeed_load']:.2f} s"],
        ["state fingerprint (at save and after a load) / DeepSpeed load", f"{result['state_fingerprint_over_load']:.3f}",
         f"{med['state_fingerprint']:.3f} s / {med['deepspeed_load']:.2f} s"],
    ]
    print(f"\n{nbytes / 2**30:.2f} GiB per checkpoint, {result['model']['parameters']:,} parameters, "
          f"median of {args.rounds} rounds\n")
    print(markdown_table(["ratio", "value", "medians"], rows))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
