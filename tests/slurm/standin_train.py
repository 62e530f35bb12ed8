"""A seconds-fast stand-in for launch/train.py with the same launcher-facing behaviour (env rendezvous on gloo,
"rank R/W started", resume from DIR/checkpoints/latest, checkpoint + exit 0 on SIGUSR1/SIGTERM, "rank R finished at
step N"), no model: it lets the SLURM plumbing (signals, requeue, resume) be tested without minutes of training."""
import argparse
import json
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--output-dir", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-seconds", type=float, default=0.5)
args = parser.parse_args()

dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
# Host names with the addresses they resolve to where the rank runs: on a multi-node cluster, each node's own.
host, master = socket.gethostname(), os.environ["MASTER_ADDR"]
print(f"rank {rank}/{world} started on {host} ({socket.gethostbyname(host)}) local_rank {os.environ['LOCAL_RANK']} "
      f"master {master}:{os.environ['MASTER_PORT']} ({socket.gethostbyname(master)})", flush=True)

received = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: received.append(signal.Signals(signum).name))

ckpt_dir = args.output_dir / "checkpoints"
step = 0
if (ckpt_dir / "latest").exists():
    tag = (ckpt_dir / "latest").read_text().strip()
    step = json.loads((ckpt_dir / tag / "state.json").read_text())["step"]
    print(f"resumed from {ckpt_dir / tag} at step {step}", flush=True)


def save(step):
    if rank == 0:
        tag = f"global_step{step}"
        (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / tag / "state.json").write_text(json.dumps({"step": step}))
        (ckpt_dir / "latest").write_text(tag)
    dist.barrier()


while step < args.steps:
    time.sleep(args.step_seconds)
    step += 1
    # Every rank stops at the same step boundary even if the signal reached them at different times.
    stop = torch.tensor([1.0 if received else 0.0])
    dist.all_reduce(stop)
    if stop.item() > 0:
        save(step)
        print(f"saved checkpoint at step {step} on signal {received[0] if received else 'from another rank'}",
              flush=True)
        dist.destroy_process_group()
        raise SystemExit(0)
save(step)
print(f"rank {rank} finished at step {step} stage real", flush=True)
dist.destroy_process_group()
