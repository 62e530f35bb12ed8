"""DeepSpeed's ZeRO-3 with the optimizer state on NVMe (``offload_optimizer: nvme``) against the same run with it in
host memory (``cpu``) and against torch's AdamW, side by side in one process: the per-step losses, the Adam
moments of a parameter that gets no gradient (in no forward), which must stay zero, and a resume from a checkpoint
saved half way (a new engine with other initial weights; in the same process, and saved and resumed in new ones as
a job is), whose losses must be the uninterrupted run's.

No plugin code runs here: this measures DeepSpeed itself, for the delink under NVMe offload (tests/test_nvme_offload.py)
to be read against. Two shapes: ``swapped`` gradients (each weight's gradient 1 MiB or more, which DeepSpeed writes
to files) and ``in-memory`` gradients (each under 1 MiB, kept in memory) in a sub-group still swapped.

    python benchmarks/nvme_offload.py --out benchmarks/results/nvme_offload.json

Needs DeepSpeed's async_io op (libaio: apt-get install libaio-dev).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, init_single_process, machine_description  # noqa: E402

# (width, layers, sub_group_size): a 600 x 600 weight's gradient is 1.4 MiB, a 256 x 256 one's 0.25 MiB; the second
# shape's 8 layers make two sub-groups, both swapped
SHAPES = {"swapped": (600, 2, 10**9), "in-memory": (256, 8, 270_000)}


def model(width: int, layers: int):
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.idle = nn.Parameter(torch.zeros(3))  # in no forward: no gradient, its moments must stay zero
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.pow(2).mean()

    torch.manual_seed(0)
    return Stack()


def batches(width: int, steps: int):
    import torch

    return [torch.randn(4, width, generator=torch.Generator().manual_seed(step)) for step in range(steps)]


def reference(width: int, layers: int, steps: int, lr: float):
    import torch

    net = model(width, layers)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for x in batches(width, steps):
        loss = net(x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = optimizer.state.get(net.idle, {})  # torch steps no parameter without a gradient: no state, zero
    return losses, state["exp_avg"].abs().max().item() if "exp_avg" in state else 0.0


def deepspeed_run(device: str, width: int, layers: int, sub_group: int, steps: int, lr: float, swap_dir: str,
                  phase: str = ""):
    """Losses, the no-gradient parameter's largest |exp_avg|, which sub-groups are swapped, and the losses of the
    steps after a checkpoint saved half way, run again by a new engine (other initial weights) resumed from it."""
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    offload = {"device": device, **({"nvme_path": f"{swap_dir}/swap"} if device == "nvme" else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_optimizer": offload, "sub_group_size": sub_group}}
    data, save_at = batches(width, steps), steps // 2

    def engine_of(seed: int):
        import torch

        net = model(width, layers)
        if seed:
            torch.manual_seed(seed)
            for param in net.parameters():
                param.data.normal_(std=0.1)
        return deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)[0]

    def train(engine, xs):
        losses = []
        for x in xs:
            loss = engine(x.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    if phase == "resume":  # a new engine (other initial weights) resumes from the checkpoint saved half way
        resumed = engine_of(1)
        resumed.load_checkpoint(f"{swap_dir}/checkpoint", tag="half")
        resumed_losses = train(resumed, data[save_at:])
        resumed.destroy()
        return resumed_losses
    if phase == "save":  # the run alone, saving half way
        engine = engine_of(0)
        losses = train(engine, data[:save_at])
        engine.save_checkpoint(f"{swap_dir}/checkpoint", tag="half")
        losses += train(engine, data[save_at:])
        engine.destroy()
        return losses
    engine = engine_of(0)
    swapped = [engine.optimizer._swappable_optimizer_subgroup(i) for i in range(len(engine.optimizer.fp16_groups))]
    losses = train(engine, data[:save_at])
    engine.save_checkpoint(f"{swap_dir}/checkpoint", tag="half")
    losses += train(engine, data[save_at:])
    idle = safe_get_full_optimizer_state(engine.module.idle, "exp_avg").abs().max().item()
    engine.destroy()
    resumed = engine_of(1)
    resumed.load_checkpoint(f"{swap_dir}/checkpoint", tag="half")
    resumed_losses = train(resumed, data[save_at:])
    resumed.destroy()
    return losses, idle, swapped, resumed_losses


def in_new_processes(device: str, shape: str, steps: int, lr: float, swap_dir: str):
    """The run saving half way, then the resume, each in a new process as a job is run and resumed: there ZeRO-3
    numbers the parameters (and so names the swap files) alike in both. (In the process above, the engines built
    before number theirs further on.) Returns the losses of the steps after the checkpoint, continued and resumed."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    losses = {}
    for phase in ("save", "resume"):
        proc = subprocess.run([sys.executable, __file__, "--in-new-process", phase, device, shape, swap_dir,
                               "--steps", str(steps), "--lr", str(lr)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the {phase} in a new process exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        losses[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    return losses["save"][steps // 2:], losses["resume"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=RESULTS / "nvme_offload.json")
    parser.add_argument("--in-new-process", nargs=4, metavar=("PHASE", "DEVICE", "SHAPE", "DIR"),
                        help="internal: the run saving into DIR (PHASE save) or the resume from it (resume); prints "
                             "the losses as JSON")
    args = parser.parse_args(argv)
    init_single_process()
    if args.in_new_process:
        phase, device, shape, swap_dir = args.in_new_process
        print(json.dumps(deepspeed_run(device, *SHAPES[shape], args.steps, args.lr, swap_dir, phase=phase)))
        sys.stdout.flush()
        os._exit(0)  # not through the interpreter's teardown, where gloo's threads can abort the process
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        print("DeepSpeed's async_io op cannot build here: apt-get install libaio-dev")
        return 2
    record = {"machine": machine_description(), "steps": args.steps, "lr": args.lr, "shapes": {}}
    for shape, (width, layers, sub_group) in SHAPES.items():
        torch_losses, torch_idle = reference(width, layers, args.steps, args.lr)
        row = {"width": width, "layers": layers, "sub_group_size": sub_group,
               "torch_adamw": {"losses": torch_losses, "idle_exp_avg": torch_idle}}
        with tempfile.TemporaryDirectory() as swap_dir:
            for device in ("cpu", "nvme"):
                losses, idle, swapped, resumed = deepspeed_run(device, width, layers, sub_group, args.steps, args.lr,
                                                               f"{swap_dir}/{device}")
                continued = losses[args.steps // 2:]
                fresh_continued, fresh = in_new_processes(device, shape, args.steps, args.lr,
                                                          f"{swap_dir}/{device}_new_processes")
                row[device] = {"losses": losses, "idle_exp_avg": idle, "sub_groups_swapped": swapped,
                               "max_abs_loss_diff_to_torch": max(abs(a - b) for a, b in zip(losses, torch_losses)),
                               "resumed_losses": resumed,
                               "max_abs_resumed_minus_continued": max(abs(a - b) for a, b in zip(resumed, continued)),
                               "new_processes_continued_losses": fresh_continued,
                               "new_processes_resumed_losses": fresh,
                               "max_abs_new_processes_resumed_minus_continued":
                                   max(abs(a - b) for a, b in zip(fresh, fresh_continued))}
        row["nvme_equals_cpu"] = row["nvme"]["losses"] == row["cpu"]["losses"]
        record["shapes"][shape] = row
        print(f"{shape} gradients ({layers} x Linear({width}, {width})), {args.steps} steps:")
        for arm in ("torch_adamw", "cpu", "nvme"):
            r = row[arm]
            diff = r.get("max_abs_loss_diff_to_torch")
            print(f"  {arm:12s} losses {' '.join(f'{v:.6f}' for v in r['losses'])}"
                  + (f"  max |loss - torch| {diff:.2e}" if diff is not None else "")
                  + f"  idle |exp_avg| {r['idle_exp_avg']:.2e}"
                  + (f"  sub-groups swapped {r['sub_groups_swapped']}" if "sub_groups_swapped" in r else ""))
            if "resumed_losses" in r:
                print(f"  {'':12s} resumed at step {args.steps // 2}: losses "
                      f"{' '.join(f'{v:.6f}' for v in r['resumed_losses'])}  max |resumed - continued| "
                      f"{r['max_abs_resumed_minus_continued']:.2e}")
                print(f"  {'':12s} saved and resumed in new processes: losses "
                      f"{' '.join(f'{v:.6f}' for v in r['new_processes_resumed_losses'])}  max |resumed - continued| "
                      f"{r['max_abs_new_processes_resumed_minus_continued']:.2e}")
        print(f"  nvme losses == cpu losses: {row['nvme_equals_cpu']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
