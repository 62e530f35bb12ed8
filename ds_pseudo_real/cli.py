"""The ``ds-pseudo-real`` command: ``train`` (the main job), ``preprocess`` (jsonl -> Megatron indexed dataset),
``convert`` (a checkpoint for another layout, or pseudo -> real), ``plan`` (granular offload placement). Each subcommand lives with the code it drives; this module only dispatches."""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "train": ("launch.train", "the main job: train through the pseudo and real stages (same flags as launch/train.py)"),
    "preprocess": ("ds_pseudo_real.preprocess", "tokenize a jsonl file into a Megatron indexed dataset (.bin/.idx)"),
    "convert": ("ds_pseudo_real.convert", "convert a checkpoint for another rank count or ZeRO stage (--to-real: a "
                                          "pseudo-stage one into the real model), offline"),
    "plan": ("ds_pseudo_real.offload.cli", "print a granular offload placement plan as a table"),
    "slurm": ("launch.slurm", "write and submit a SLURM batch script (same flags as python -m launch.slurm)"),
    "hostfile": ("launch.hostfile", "write a DeepSpeed hostfile (same flags as python -m launch.hostfile)"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items()]
        print("usage: ds-pseudo-real {" + ",".join(COMMANDS) + "} ...\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nds-pseudo-real: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
