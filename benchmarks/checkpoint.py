"""Checkpoint benchmark: how long a save blocks the training loop, how long it takes in all, and what verifying costs.

For each model size and rank count, one torchrun job (ZeRO 1, fp32 weights and AdamW unless ``--dtype``,
``--optimizer``) saves the same state round after round, the arms alternating within each round, each round starting
one arm later (every arm follows every other as often), so that machine noise falls on every arm
(``--sync-between-arms``: the writeback of what the arm before left dirty is done before each arm starts); the first
round (``--warmup-rounds``) is left out of the medians (each arm's first save meets a cold page cache, the async one
allocates its snapshot):
- plain DeepSpeed ``save_checkpoint`` (files left in the page cache);
- the plugin, synchronous (each file checksummed as it is written and fsynced, the manifest added, atomic rename);
- the plugin with ``checkpoint.async_save``: blocked = until ``save_checkpoint`` returns (the host snapshot), total =
  until ``wait_for_checkpoints`` returns (written, checksummed, fsynced and published in the background);
- DeepSpeed 0.19.8's decoupled engine alone (``checkpoint.writer`` ``{"type": "python", "decoupled": true}``),
  for reference: blocked = its ``save_checkpoint``, total = until its commit (which the next optimizer step waits for).
Then a training loop that saves every N steps, per save mode, against the same loop without saves (steps/s).
On one rank it also measures the load side: ``checkpoint.verify`` checksum and size, and the state fingerprint,
against DeepSpeed's own ``load_checkpoint``. Times of several ranks are the slowest rank's.

    python benchmarks/checkpoint.py                  # 85.5M and 1.0B parameters, 1 and 2 ranks
    python benchmarks/checkpoint.py --sizes 85m,340m --rounds 3 --loop-steps 10
    python benchmarks/checkpoint.py --quick          # a small model, 1 and 2 ranks, about 2 min

A size whose training state and snapshot would not fit in the memory available now is skipped and recorded so (1.0B
parameters need about 41 GiB free on 1 rank and 50 GiB on 2 with Adam, 19 and 23 GiB with ``--dtype bf16 --optimizer
sgd``; 85.3M about 4 GiB).
Writes benchmarks/results/checkpoint.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, machine_description, markdown_table, median, write_json  # noqa: E402

# name: (layers, d_model); heads of 64
SIZES = {"tiny": (4, 128), "85m": (12, 768), "340m": (12, 1536), "1b": (20, 2048)}
ARMS = ("plain", "plugin_sync", "plugin_async", "decoupled")
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "sgd": {"type": "SGD", "params": {"lr": 1e-4}}}  # torch.optim.SGD without momentum: no state
DTYPES = ("fp32", "bf16")


def needed_bytes(parameters: int, ranks: int, dtype: str = "fp32", optimizer: str = "adamw") -> int:
    """Host memory a job of ``ranks`` needs at ZeRO 1, with 10 % for the rest (activations, the processes).

    Per parameter: the weights and their gradients on every rank (4 + 4 bytes in fp32, 2 + 2 in bf16); split between
    the ranks, the fp32 master and its gradient during the step (4 + 4) and the moments (8 with Adam, none with SGD);
    the snapshots of the async save hold what the ranks write: the weights once, the master and the moments. The
    decoupled engine adds nothing (it shares the live tensors with its writer process)."""
    weight = 2 if dtype == "bf16" else 4
    moments = 8 if optimizer == "adamw" else 0
    training = 2 * weight * ranks + 8 + moments
    snapshot = weight + 4 + moments
    return int(parameters * (training + snapshot) * 1.1)


def available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) * 1024


def gpt_parameters(layers: int, d_model: int, vocab: int = 256, seq_len: int = 32) -> int:
    return layers * (12 * d_model * d_model + 13 * d_model) + (vocab + seq_len) * d_model + 2 * d_model


# ---- the worker: one job, every rank -------------------------------------------------------------------------------
def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_pseudo_real
    from ds_pseudo_real import ds_state
    from ds_pseudo_real.checkpointing.verify import verify
    from ds_pseudo_real.ranks import barrier, gather
    from ds_pseudo_real.models import GPT, GPTConfig

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    layers, d_model = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, d_model=d_model, n_head=max(1, d_model // 64), seq_len=32))
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
              "optimizer": OPTIMIZERS[args.optimizer], "bf16": {"enabled": args.dtype == "bf16"},
              "zero_allow_untested_optimizer": True,  # SGD: a torch optimizer DeepSpeed's ZeRO did not list
              "checkpoint": {"async_save": True}}
    engine, *_ = ds_pseudo_real.initialize(model=model, config=config)
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(rank))

    def step():
        engine.backward(engine(x, x))
        engine.step()

    step()  # the optimizer's state exists
    ds = engine.engine
    decoupled, torch_engine = decoupled_engine(ds), ds.checkpoint_engine
    root = Path(args.root)

    def slowest(seconds: float) -> float:
        return max(gather(seconds))

    def fresh(folder: Path) -> str:
        barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        barrier()
        return str(folder)

    def save(arm: str, folder: str, tag: str):
        """(blocked s, total s) of one save of ``arm`` on this rank."""
        start = time.perf_counter()
        if arm == "plain":
            ds.save_checkpoint(folder, tag=tag)
            return (time.perf_counter() - start,) * 2
        if arm == "decoupled":
            ds.checkpoint_engine = decoupled
            try:
                ds.save_checkpoint(folder, tag=tag)
                blocked = time.perf_counter() - start
                ds._commit_decoupled_checkpoint()  # what the next optimizer step would wait for (DeepSpeed 0.19.8)
            finally:
                ds.checkpoint_engine = torch_engine
            return blocked, time.perf_counter() - start
        engine.checkpoint_options.async_save = arm == "plugin_async"
        engine.save_checkpoint(folder, tag=tag)
        blocked = time.perf_counter() - start
        engine.wait_for_checkpoints()
        return blocked, time.perf_counter() - start

    measured = {arm: {"blocked": [], "total": []} for arm in ARMS}
    warmup = {arm: {"blocked": [], "total": []} for arm in ARMS}
    load = {key: [] for key in ("verify_checksum", "verify_size", "deepspeed_load", "state_fingerprint")}
    nbytes = 0
    for round_ in range(args.warmup_rounds + args.rounds):
        times = warmup if round_ < args.warmup_rounds else measured
        # Each round starts one arm later, so that every arm follows every other as often: on a disk shared with
        # other machines, an arm pays for what the arm before it left to write back (plain DeepSpeed does not fsync).
        for arm in ARMS[round_ % len(ARMS):] + ARMS[:round_ % len(ARMS)]:
            folder = fresh(root / arm)
            if args.sync_between_arms:  # the arm before's dirty pages written out now, not during this arm's save
                os.sync()
            barrier()
            blocked, total = save(arm, folder, "t")
            times[arm]["blocked"].append(slowest(blocked))
            times[arm]["total"].append(slowest(total))
        verdict = verify(str(root / "plugin_sync"), "t", "checksum")
        assert verdict.ok, verdict.problems
        nbytes = verdict.nbytes
        if world == 1 and times is measured:
            load["verify_checksum"].append(verdict.seconds)
            load["verify_size"].append(verify(str(root / "plugin_sync"), "t", "size").seconds)
            start = time.perf_counter()
            ds.load_checkpoint(str(root / "plugin_sync"), "t")
            load["deepspeed_load"].append(time.perf_counter() - start)
            start = time.perf_counter()  # the plugin's check that a load restored the state: at save and after a load
            ds_state.state_fingerprint(ds)
            load["state_fingerprint"].append(time.perf_counter() - start)
        if rank == 0:
            kind = "warm-up round" if times is warmup else "round"
            print(f"{args.size} x {world}: {kind} {round_ + 1}/{args.warmup_rounds + args.rounds}: " + ", ".join(
                f"{arm} {t['blocked'][-1]:.3f}/{t['total'][-1]:.3f} s" for arm, t in times.items()), flush=True)
    for arm in ARMS:
        fresh(root / arm)

    loop = {}
    for mode in ("none",) + ARMS:
        folder = fresh(root / "loop")
        for _ in range(2):  # warm: the first steps after the saves above, and the first snapshot's buffers
            step()
        barrier()
        start, blocked, waits, saves = time.perf_counter(), [], 0, 0
        for i in range(1, args.loop_steps + 1):
            step()
            if mode != "none" and i % args.save_every == 0:
                waits += engine.checkpoint_in_flight is not None
                began = time.perf_counter()
                if mode == "plain":
                    ds.save_checkpoint(folder, tag="loop")
                elif mode == "decoupled":
                    ds.checkpoint_engine = decoupled  # committed by the next step (DeepSpeed's own)
                    ds.save_checkpoint(folder, tag="loop")
                else:
                    engine.checkpoint_options.async_save = mode == "plugin_async"
                    engine.save_checkpoint(folder, tag="loop")
                blocked.append(time.perf_counter() - began)
                saves += 1
        if mode == "decoupled":
            ds._commit_decoupled_checkpoint()
            ds.checkpoint_engine = torch_engine
        engine.wait_for_checkpoints()
        seconds = slowest(time.perf_counter() - start)
        loop[mode] = {"steps_per_s": args.loop_steps / seconds, "saves": saves,
                      "waits_for_a_save_in_flight": max(gather(waits)),
                      "median_blocked_s": max(gather(median(blocked) if blocked else 0.0))}
        if rank == 0:
            print(f"{args.size} x {world}: loop with saves '{mode}' every {args.save_every} steps: "
                  f"{loop[mode]['steps_per_s']:.3f} steps/s", flush=True)
    fresh(root / "loop")
    decoupled.cleanup()
    if rank == 0:
        result = {"parameters": ds_pseudo_real.parameter_count(engine.module), "layers": layers, "d_model": d_model,
                  "ranks": world, "checkpoint_bytes": nbytes, "rounds": args.rounds, "seconds": measured,
                  "warmup_seconds": warmup,
                  "loop": {"steps": args.loop_steps, "save_every": args.save_every, **loop}}
        if world == 1:
            result["load_seconds"] = load
        Path(args.json_out).write_text(json.dumps(result))
    dist.destroy_process_group()


def decoupled_engine(ds):
    """DeepSpeed's decoupled checkpoint engine for ``ds``, made by its own factory with a python writer (the fast one
    needs libaio) and one writer per data-parallel rank ("replica": without it 0.19.8 fails on a missing dp_rank).
    Its save hands the state to a writer process through a queue, which refuses ZeRO 1/2's flat fp32 partitions
    (non-leaf tensors requiring grad): they are detached here, as a view of the same memory (DeepSpeed 0.19.8)."""
    from deepspeed.runtime.model_checkpointing.config import get_checkpoint_writer_config

    os.environ.setdefault("CROSS_SIZE", "1")  # set by DeepSpeed's launcher; torchrun sets none
    os.environ.setdefault("CROSS_RANK", "0")
    torch_engine = ds.checkpoint_engine
    ds._config.checkpoint_config["writer"] = get_checkpoint_writer_config(
        {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}})
    ds._configure_checkpointing()
    decoupled, ds.checkpoint_engine = ds.checkpoint_engine, torch_engine
    ds._config.checkpoint_config["writer"] = None
    hand_off = decoupled.save
    decoupled.save = lambda state_dict, path: hand_off(_detached(state_dict), path)
    return decoupled


def _detached(obj):
    import torch

    if torch.is_tensor(obj):
        return obj.detach()
    if isinstance(obj, dict):
        return type(obj)((k, _detached(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


# ---- the driver -------------------------------------------------------------------------------------------------
def run_job(size: str, ranks: int, args) -> dict:
    layers, d_model = SIZES[size]
    parameters = gpt_parameters(layers, d_model)
    need, have = needed_bytes(parameters, ranks, args.dtype, args.optimizer), available_bytes()
    if need > have:
        reason = (f"skipped: {parameters / 1e6:,.0f}M parameters on {ranks} ranks need about {need / 2**30:.1f} GiB "
                  f"(training state and one snapshot), {have / 2**30:.1f} GiB available")
        print(f"{size} x {ranks}: {reason}", flush=True)
        return {"parameters": parameters, "ranks": ranks, "skipped": reason}
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_", dir=args.dir) as root:
        out = Path(root) / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(REPO))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                   str(29500 + os.getpid() % 1000), __file__, "--worker", "--size", size, "--rounds", str(args.rounds),
                   "--warmup-rounds", str(args.warmup_rounds), "--loop-steps", str(args.loop_steps), "--save-every",
                   str(args.save_every), "--dtype", args.dtype, "--optimizer", args.optimizer,
                   "--root", str(Path(root) / "ckpt"), "--json-out", str(out),
                   *(["--sync-between-arms"] if args.sync_between_arms else [])]
        subprocess.run(command, env=env, check=True)
        return json.loads(out.read_text())


def summarize(job: dict) -> dict:
    """Medians and the ratios to plain DeepSpeed's save."""
    med = {arm: {kind: median(values) for kind, values in t.items()} for arm, t in job["seconds"].items()}
    plain = med["plain"]["blocked"]
    summary = {"median_seconds": med,
               "blocked_over_plain": {arm: med[arm]["blocked"] / plain for arm in ARMS},
               "total_over_plain": {arm: med[arm]["total"] / plain for arm in ARMS},
               "async_total_over_sync": med["plugin_async"]["total"] / med["plugin_sync"]["total"]}
    loop = job["loop"]
    summary["loop_steps_per_s_over_no_saves"] = {mode: loop[mode]["steps_per_s"] / loop["none"]["steps_per_s"]
                                                 for mode in ARMS}
    if "load_seconds" in job:
        load = {key: median(values) for key, values in job["load_seconds"].items()}
        summary["load_median_seconds"] = load
        summary["verify_checksum_over_load"] = load["verify_checksum"] / load["deepspeed_load"]
        summary["verify_size_over_load"] = load["verify_size"] / load["deepspeed_load"]
        summary["state_fingerprint_over_load"] = load["state_fingerprint"] / load["deepspeed_load"]
        summary["checksum_gib_per_s"] = job["checkpoint_bytes"] / load["verify_checksum"] / 2**30
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="85m,1b", help=f"of {sorted(SIZES)}")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds saved first and left out of the medians (kept in the JSON as warmup_seconds): the "
                             "first save of an arm allocates its buffers and meets a cold page cache")
    parser.add_argument("--loop-steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--sync-between-arms", action="store_true",
                        help="os.sync() before each arm's save in the rounds: plain DeepSpeed does not fsync, and the "
                             "kernel's writeback of what an arm left dirty otherwise falls on the arm after it")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="of the weights (the master is fp32)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                        help="sgd (no momentum) has no state: a size's checkpoint without the Adam moments, for a "
                             "size whose Adam state would not fit the host")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 rounds")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    parser.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.sizes, args.rounds = "tiny", 3
    unknown = [size for size in args.sizes.split(",") if size not in SIZES]
    if unknown:
        parser.error(f"--sizes {args.sizes}: unknown {unknown}; expected some of {sorted(SIZES)}")
    jobs = []
    for size in args.sizes.split(","):
        for ranks in map(int, args.ranks.split(",")):
            job = run_job(size, ranks, args)
            if "skipped" not in job:
                job.update(summarize(job))
            jobs.append({"size": size, **job})
    result = {"machine": machine_description(), "zero_stage": 1, "dtype": args.dtype, "optimizer": args.optimizer,
              "arm_order": "rotated each round",
              "sync_between_arms": args.sync_between_arms, "jobs": jobs}
    write_json(Path(args.out), result)
    rows = []
    for job in jobs:
        name = f"{job['parameters'] / 1e6:,.1f}M x {job['ranks']}"
        if "skipped" in job:
            rows.append([name, job["skipped"], "", "", ""])
            continue
        med, loop = job["median_seconds"], job["loop"]
        rows.append([name, f"{job['checkpoint_bytes'] / 2**30:.2f} GiB",
                     ", ".join(f"{arm} {med[arm]['blocked']:.2f}" for arm in ARMS),
                     ", ".join(f"{arm} {job['blocked_over_plain'][arm]:.2f}x" for arm in ARMS[1:]),
                     ", ".join(f"{arm} {med[arm]['total']:.2f}" for arm in ARMS[1:]),
                     ", ".join(f"{mode} {job['loop_steps_per_s_over_no_saves'][mode]:.2f}" for mode in ARMS)
                     + f" (no saves {loop['none']['steps_per_s']:.2f} steps/s)"])
    print()
    print(markdown_table(["parameters x ranks", "checkpoint", "blocked s (median)", "blocked / plain DeepSpeed",
                          "total s", f"steps/s saving every {args.save_every} / without"], rows))
    for job in jobs:
        if "verify_checksum_over_load" in job:
            print(f"\n{job['size']}, 1 rank: verify checksum / DeepSpeed load {job['verify_checksum_over_load']:.3f} "
                  f"({job['checksum_gib_per_s']:.2f} GiB/s), size {job['verify_size_over_load']:.4f}, state fingerprint "
                  f"{job['state_fingerprint_over_load']:.3f}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
