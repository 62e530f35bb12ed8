"""Pseudo-stage throughput on its own layout against the real layout, side by side in one run on the same ranks.

    python benchmarks/layouts.py [--nproc 2] [--real-layout tp=2 --real-layout pp=2] [--iters 12] [--out DIR]

The pseudo model is small enough to need far less model parallelism than the real one; this measures what that
is worth. One torchrun job of NPROC ranks runs Megatron-LM's ``pretrain_gpt.py`` (``MEGATRON_LM_PATH``) through the
drop-in once per layout, in the same processes: the pseudo model (every layer sharing one set; the switch beyond
the last iteration) on pure data parallelism (the pseudo stage's own layout), then on each real layout, with
Megatron-LM's in-process teardown between them (``destroy_global_state``, what ``--pseudo-to-real-real-layout``
uses). Tokens/s of a layout = global batch x sequence length / Megatron's time per iteration (the median after the
warm-up iterations). Prints the table; writes benchmarks/results/layouts.json (``--out``). On CUDA it runs on
NCCL (one GPU per rank); the CPU figures are gloo ranks sharing the machine's cores.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, machine_description, markdown_table, median, write_json  # noqa: E402

TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|")
PASS_MARK = "[layouts benchmark] pass "


def layout_flags(layout: Dict) -> List[str]:
    """Megatron-LM's flags for a parsed ``--pseudo-to-real-real-layout`` value (``run.parse_layout``)."""
    flags = []
    for name, value in layout.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, str(value)]
    return flags


def model_flags(args) -> List[str]:
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
             str(args.heads), "--seq-length", str(args.seq_len), "--max-position-embeddings", str(args.seq_len),
             "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.global_batch),
             "--lr", "1e-4", "--train-iters", str(args.iters), "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(args.vocab), "--transformer-impl", "local", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1",
             "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             # the pseudo model throughout: every layer shares one set, the switch never comes
             "--pseudo-to-real-switch-iter", str(args.iters + 1)]
    if args.bf16:
        flags += ["--bf16", "--no-masked-softmax-fusion"]
    return flags


def worker(script: str, passes: Sequence[Sequence[str]]) -> None:
    """One rank: the script once per pass, in this process (Megatron-LM's teardown between passes)."""
    import torch.distributed as dist

    import megatron.training.training as training
    from megatron_patches import cpu_compat, run

    cpu_compat.install_training()  # a no-op with CUDA
    run.install()
    try:
        for n, flags in enumerate(passes):
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"{PASS_MARK}{n}", flush=True)
            sys.argv = [script, *flags]
            runpy.run_path(script, run_name="__main__")
            training.destroy_global_state()
    finally:
        run.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def tokens_per_second(stdout: str, passes: int, warmup: int, tokens_per_iteration: int) -> List[Dict]:
    """Per pass: Megatron's median time per iteration after ``warmup`` iterations, and tokens/s."""
    out = []
    for n, text in enumerate(stdout.split(PASS_MARK)[1:passes + 1]):
        times = [float(ms) for i, ms in TIME.findall(text) if int(i) > warmup]
        if not times:
            raise RuntimeError(f"pass {n}: no iteration after the {warmup} warm-up ones in the log")
        ms = median(times)
        out.append({"iteration_ms": ms, "tokens_per_s": tokens_per_iteration / (ms / 1e3), "iterations": len(times)})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU on CUDA)")
    p.add_argument("--real-layout", action="append", default=None,
                   help="a real layout, as --pseudo-to-real-real-layout takes it (repeatable; default tp=2 and pp=2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="iterations left out of the median")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_patches.run import format_layout, parse_layout

    script = Path(os.environ.get("MEGATRON_LM_PATH", "")) / "pretrain_gpt.py"
    if args.worker is not None:
        separator = args.worker.index("--pass")
        passes, current = [], None
        for item in args.worker[separator:]:
            if item == "--pass":
                current = []
                passes.append(current)
            else:
                current.append(item)
        worker(str(script), passes)
        return 0
    if not script.is_file():
        print(f"benchmarks/layouts.py: MEGATRON_LM_PATH={os.environ.get('MEGATRON_LM_PATH')!r} holds no "
              f"pretrain_gpt.py (a Megatron-LM checkout of tag core_v0.16.1)", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < args.nproc:
        print(f"benchmarks/layouts.py: {args.nproc} ranks need {args.nproc} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    layouts = [parse_layout(text) for text in (args.real_layout or ["tp=2", "pp=2"])]
    common = [*model_flags(args), "--distributed-backend", "nccl" if cuda else "gloo"]
    passes = [common] + [[*common, *layout_flags(layout)] for layout in layouts]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve()), "--worker"]
    for flags in passes:
        cmd += ["--pass", *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(script.parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if cuda:  # Megatron-LM's requirement for tensor parallelism before Blackwell
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:] + proc.stderr[-6000:], file=sys.stderr)
        return proc.returncode
    tokens = args.global_batch * args.seq_len
    measured = tokens_per_second(proc.stdout, len(passes), args.warmup, tokens)
    names = [f"dp={args.nproc} (pseudo stage's own)"] + [format_layout(layout) for layout in layouts]
    own = measured[0]["tokens_per_s"]
    rows = [[name, f"{m['iteration_ms']:.1f}", f"{m['tokens_per_s']:.0f}", f"{own / m['tokens_per_s']:.2f}"]
            for name, m in zip(names, measured)]
    print(markdown_table(["pseudo model on", "ms / iteration", "tokens/s", "own layout's tokens/s over this"], rows))
    result = {"what": __doc__.splitlines()[0], "device": "cuda" if cuda else "cpu", "nproc": args.nproc,
              "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch",
                                                      "global_batch", "iters", "warmup", "bf16")},
              "layouts": [{"layout": name, **m, "own_over_this": own / m["tokens_per_s"]}
                          for name, m in zip(names, measured)],
              "command": " ".join(["python", "benchmarks/layouts.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_description()}
    print(f"wrote {write_json(args.out / ('layouts_gpu.json' if cuda else 'layouts.json'), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
