"""The host step off the critical path, measured on the CPU: step time of granular offload's host step after the
backward (``sequential``), during it (``overlapped``) and one step late, during the next forward and backward
(``delayed``: a change of the math, so its losses differ), beside DeepSpeed's own ZeRO-2 CPU offload and
SuperOffload, on one model and the same batches, with the losses compared.

On a CPU the "device" work (forward, backward, the copies of host_params layers) and the host step share the
machine, so the comparison is honest only when each gets a core of its own: the training thread runs torch with one
thread, the host step's worker DeepSpeed's CPU Adam with one OpenMP thread (``OMP_NUM_THREADS=1``), on a 2-core
machine. Every layer is at host_params under ZeRO 2 (own groups: the ones the overlapped step can take), fp32
(``--dtype bf16``: half the bytes copied, and the step rounds a master into the host params), gradient clipping off
(``--clip`` on: the groups stepped ahead keep backups, and a norm that clips makes them redo).
The balanced case is the one where the sequential arm's forward+backward and its step take about as long
(``--tokens`` sets the batch; the table prints both parts): ``--dtype bf16 --tokens 4`` here. Both sides are mostly
bound by memory bandwidth on a CPU, so the run first measures what two cores move together against one (a triad):
overlapping two bandwidth-bound streams takes at least one over that ratio of their time one after the other. The arms are timed interleaved, a block of steps each,
round after round, so the machine's noise falls on all of them; the ratio is the median block time over the
sequential arm's. On the CPU the allocator keeps freed blocks, as CUDA's caching allocator does
(``common.keep_freed_blocks``; ``--host-allocator system`` leaves glibc's default, under which every fetch of a
released layer and every fresh weight gradient faults its pages in again: a fifth of the forward+backward here).

    OMP_NUM_THREADS=1 python benchmarks/host_step.py      # ~3 min on 2 cores; writes results/host_step.json
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    RESULTS, init_single_process, keep_freed_blocks, machine_description, markdown_table, median, timed_step,
    write_json,
)

ARMS = ("sequential", "overlapped", "delayed", "deepspeed_zero2_offload", "superoffload")
OFFLOAD_ARMS = ("sequential", "overlapped", "delayed")  # granular offload's host_step values


def make_model(d: int, layers: int, vocab: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList([Block() for _ in range(layers)])
            self.head = nn.Linear(d, vocab)

        def forward(self, x, y):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            logits = self.head(h)
            return nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1))

    torch.manual_seed(0)
    return Stack()


def base_config(args) -> Dict:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "gradient_clipping": args.clip, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    if args.dtype == "bf16":  # without DeepSpeed's overflow check no step can be refused: no backups (docs/offload.md)
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    return config


def build(arm: str, args):
    """The engine of ``arm``, or the reason it cannot run here."""
    import deepspeed

    from ds_pseudo_real.offload import attach_to_engine, build_offload_optimizer

    model = make_model(args.hidden, args.layers, args.vocab)
    config = base_config(args)
    if arm in OFFLOAD_ARMS:
        config["granular_offload"] = {"levels": {**{str(i): "host_params" for i in range(args.layers)},
                                                 "other": "device"}, "host_step": arm}
        if arm == "delayed":
            config["granular_offload"]["delayed_from_step"] = 0
        optimizer, patched, _ = build_offload_optimizer(model, config, "layers", 1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=patched)
        attach_to_engine(engine)
        return engine, optimizer
    config = copy.deepcopy(config)
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    if arm == "superoffload":
        config["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, None


def batch(step: int, tokens: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (1, tokens), generator=g)
    return x, x.roll(-1, 1)


def run_block(engine, first: int, count: int, args, parts: Dict[str, List[float]]) -> List[float]:
    losses = []
    for step in range(first, first + count):
        x, y = (t.to(engine.device) for t in batch(step, args.tokens, args.vocab))
        loss, forward_backward, optimizer_step = timed_step(engine, x, y)
        parts["forward_backward"].append(forward_backward)
        parts["step"].append(optimizer_step)
        losses.append(loss.item())
    return losses


def memory_bandwidth(numel: int = 16 * 2**20, repeats: int = 20, samples: int = 5) -> Dict[str, float]:
    """A triad (a = b + 2c, 12 bytes an element) on one thread, then on two threads at once: GB/s each way, the
    median of ``samples`` of each. Both
    sides of the CPU's overlap (the copies and compute of the "device", the host Adam) are mostly bound by memory
    bandwidth, so what two cores move together against one bounds what overlapping them can save."""
    import threading

    import torch

    tensors = [(torch.empty(numel), torch.rand(numel), torch.rand(numel)) for _ in range(2)]
    for a, b, c in tensors:
        torch.add(b, c, alpha=2.0, out=a)  # pages touched

    def triad(a, b, c) -> None:
        for _ in range(repeats):
            torch.add(b, c, alpha=2.0, out=a)

    ones, twos = [], []
    for _ in range(samples):  # interleaved, medians: the machine's load moves
        start = time.perf_counter()
        triad(*tensors[0])
        ones.append(12 * numel * repeats / (time.perf_counter() - start) / 1e9)
        threads = [threading.Thread(target=triad, args=t) for t in tensors]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        twos.append(2 * 12 * numel * repeats / (time.perf_counter() - start) / 1e9)  # both threads' bytes
    one, two = median(ones), median(twos)
    return {"one_thread_gb_per_s": one, "two_threads_gb_per_s": two, "two_over_one": two / one,
            "samples": samples}


def measure(args) -> Dict:
    engines, refused = {}, {}
    for arm in args.arms:
        try:
            engines[arm] = build(arm, args)
        except Exception as error:  # DeepSpeed refuses an arm on this machine: recorded, not fatal
            refused[arm] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            print(f"  {arm}: cannot run here ({refused[arm]})", flush=True)
    blocks = {arm: [] for arm in engines}
    parts = {arm: {"forward_backward": [], "step": []} for arm in engines}
    losses = {arm: [] for arm in engines}
    step = 0
    for round_ in range(args.warmup + args.rounds):
        for arm, (engine, _) in engines.items():
            start = time.perf_counter()
            losses[arm] += run_block(engine, step, args.block, args, parts[arm])
            if round_ >= args.warmup:
                blocks[arm].append((time.perf_counter() - start) / args.block)
        step += args.block
        print(f"  round {round_ + 1}/{args.warmup + args.rounds}: " + ", ".join(
            f"{arm} {blocks[arm][-1] * 1e3:.1f} ms/step" for arm in blocks if blocks[arm]), flush=True)
    skip = args.warmup * args.block
    rows = {}
    for arm, (engine, optimizer) in engines.items():
        ahead, late = getattr(optimizer, "ahead", None), getattr(optimizer, "delayed", None)
        rows[arm] = {
            "step_seconds": median(blocks[arm]),
            "forward_backward_seconds": median(parts[arm]["forward_backward"][skip:]),
            "optimizer_step_seconds": median(parts[arm]["step"][skip:]),
            "losses": losses[arm],
            "stepped_ahead": ahead.stepped_ahead if ahead else None,
            "steps_delayed": late.delayed if late else None,
            "redone": ahead.redone if ahead else None,
            "held": ahead.held if ahead else None,
        }
    base = rows["sequential"]["step_seconds"]
    for arm, row in rows.items():
        row["ratio_to_sequential"] = row["step_seconds"] / base
        row["losses_equal_to_sequential"] = row["losses"] == rows["sequential"]["losses"]
        row["max_loss_difference"] = max(abs(a - b) for a, b in zip(row["losses"], rows["sequential"]["losses"]))
    return {"rows": rows, "refused": refused}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tokens", type=int, default=8, help="tokens per step: sets the forward+backward's share")
    p.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: 2-byte host params and copies, an fp32 master rounded into them after each step")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--block", type=int, default=5, help="steps per arm per round")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, the host step's kernel threads too (1 on the CPU: a core for each side)")
    p.add_argument("--host-allocator", choices=("caching", "system"), default="caching",
                   help="on the CPU: keep freed blocks as CUDA's caching allocator does (default), or glibc's default")
    p.add_argument("--triad-numel", type=int, default=16 * 2**20,
                   help="elements of each array of the memory-bandwidth triad (out of every cache)")
    p.add_argument("--out", type=Path, default=RESULTS / "host_step.json")
    args = p.parse_args(argv)
    if "sequential" not in args.arms:
        p.error("--arms: the sequential arm is the baseline; include it")
    init_single_process(threads=args.threads)
    import torch

    caching = args.host_allocator == "caching" and not torch.cuda.is_available() and keep_freed_blocks()
    print(f"host allocator: {'freed blocks kept (as a caching allocator)' if caching else 'the system default'}",
          flush=True)
    print(f"host step benchmark: {args.layers} layers of hidden {args.hidden} at host_params, ZeRO 2, {args.dtype}, "
          f"{args.tokens} tokens per step, gradient_clipping {args.clip}", flush=True)
    bandwidth = memory_bandwidth(args.triad_numel)
    print(f"memory bandwidth (triad): one thread {bandwidth['one_thread_gb_per_s']:.1f} GB/s, two at once "
          f"{bandwidth['two_threads_gb_per_s']:.1f} GB/s ({bandwidth['two_over_one']:.2f}x): two bandwidth-bound "
          f"streams overlapped take at least {1 / bandwidth['two_over_one']:.2f}x their time one after the other",
          flush=True)
    result = measure(args)
    table = markdown_table(
        ["arm", "ms/step", "ratio", "forward+backward ms", "optimizer step ms", "losses equal",
         "stepped ahead / late"],
        [[arm, f"{r['step_seconds'] * 1e3:.1f}", f"{r['ratio_to_sequential']:.3f}",
          f"{r['forward_backward_seconds'] * 1e3:.1f}", f"{r['optimizer_step_seconds'] * 1e3:.1f}",
          "yes" if r["losses_equal_to_sequential"] else f"no (max {r['max_loss_difference']:.2g})",
          f"{r['steps_delayed']} steps late" if r["steps_delayed"] is not None else
          "-" if r["stepped_ahead"] is None else f"{r['stepped_ahead']} (redone {r['redone']}, steps held {r['held']})"]
         for arm, r in result["rows"].items()])
    print(table)
    for arm, why in result["refused"].items():
        print(f"{arm}: not run: {why}")
    for row in result["rows"].values():
        row["losses"] = [round(x, 6) for x in row["losses"][-5:]]  # the last few; equality is recorded above
    write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "machine": machine_description(),
                          "host_allocator_keeps_freed_blocks": caching,
                          "memory_bandwidth": bandwidth,
                          "median_note": "block times: median over rounds; parts: median over steps", **result})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
