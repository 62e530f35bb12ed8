"""The ``ds-pseudo-real`` command: ``train`` (the main job), ``preprocess`` (jsonl -> Megatron indexed dataset),
``convert`` (a checkpoint for another layout, or pseudo -> real), ``plan`` (granular offload placement), ``slurm``
and ``hostfile``. Each subcommand lives with the code it drives and is declared in the package's metadata
(setup.py's ``ds_pseudo_real.commands`` entry points); this module only dispatches."""
from __future__ import annotations

import sys
from importlib.metadata import entry_points
from typing import List, Optional

GROUP = "ds_pseudo_real.commands"
DESCRIPTIONS = {
    "train": "the main job: train through the pseudo and real stages (same flags as launch/train.py)",
    "preprocess": "tokenize a jsonl file into a Megatron indexed dataset (.bin/.idx)",
    "convert": "convert a checkpoint for another rank count or ZeRO stage (--to-real: a pseudo-stage one into the "
               "real model), offline",
    "plan": "print a granular offload placement plan as a table",
    "slurm": "write and submit a SLURM batch script (same flags as python -m launch.slurm)",
    "hostfile": "write a DeepSpeed hostfile (same flags as python -m launch.hostfile)",
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in DESCRIPTIONS:
        lines = [f"  {name:<10} {doc}" for name, doc in DESCRIPTIONS.items()]
        print("usage: ds-pseudo-real {" + ",".join(DESCRIPTIONS) + "} ...\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nds-pseudo-real: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    declared = {point.name: point for point in entry_points(group=GROUP)}
    if argv[0] not in declared:
        print(f"ds-pseudo-real: error: the command {argv[0]!r} is not declared in this installation's metadata "
              f"(entry points {GROUP!r}); install the package again: pip install -e .", file=sys.stderr)
        return 2
    return declared[argv[0]].load()(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
