"""A DeepSpeed hostfile (``host slots=N`` per line) for ``deepspeed --hostfile FILE`` launches over ssh/pdsh.

``python -m launch.hostfile --nodes 'gpu[001-004]' --slots 8 -o hostfile``, or ``--from-slurm`` inside an
allocation. Format written against DeepSpeed 0.19.8's ``deepspeed.launcher.runner._parse_hostfile``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from launch.dist_env import expand_nodelist, parse_tasks_per_node


def hostfile_text(hosts: Sequence[str], slots: int | Sequence[int]) -> str:
    """One ``host slots=N`` line per host; ``slots`` is one count for all hosts or one per host."""
    counts = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    if len(counts) != len(hosts):
        raise ValueError(f"{len(hosts)} hosts but {len(counts)} slot counts ({counts}): give one count or one per host")
    seen = set()
    for host, count in zip(hosts, counts):
        if host in seen:
            raise ValueError(f"host {host!r} is listed twice; DeepSpeed refuses duplicate hostfile entries")
        if not host or any(c.isspace() for c in host) or host.startswith("#"):
            raise ValueError(f"host {host!r}: expected a host name without spaces, not starting with '#'")
        if count < 1:
            raise ValueError(f"host {host!r}: slots={count}, expected at least 1 (one slot = one GPU = one rank)")
        seen.add(host)
    return "".join(f"{host} slots={count}\n" for host, count in zip(hosts, counts))


def hostfile_from_slurm(environ: Mapping[str, str]) -> str:
    """The hostfile for the current allocation: its nodes, slots = GPUs per node, else tasks per node."""
    if not environ.get("SLURM_JOB_NODELIST"):
        raise KeyError("--from-slurm: SLURM_JOB_NODELIST is not set (run inside salloc/sbatch)")
    hosts = expand_nodelist(environ["SLURM_JOB_NODELIST"])
    if environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return hostfile_text(hosts, int(environ["SLURM_GPUS_ON_NODE"]))
    if environ.get("SLURM_TASKS_PER_NODE"):
        return hostfile_text(hosts, parse_tasks_per_node(environ["SLURM_TASKS_PER_NODE"]))
    raise KeyError("--from-slurm: neither SLURM_GPUS_ON_NODE nor SLURM_TASKS_PER_NODE is set; pass --nodes/--slots")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.hostfile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", help="SLURM-style host list, e.g. 'gpu[001-004,010]' or 'node1,node2'")
    parser.add_argument("--slots", type=int, default=None, help="ranks (GPUs) per host")
    parser.add_argument("--from-slurm", action="store_true", help="hosts and slots of the current SLURM allocation")
    parser.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: print)")
    args = parser.parse_args(argv)
    if args.from_slurm == bool(args.nodes):
        parser.error("give exactly one of --nodes (with --slots) or --from-slurm")
    if args.nodes:
        if args.slots is None:
            parser.error(f"--nodes {args.nodes!r} needs --slots N (ranks per host)")
        text = hostfile_text(expand_nodelist(args.nodes), args.slots)
    else:
        text = hostfile_from_slurm(os.environ)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output} ({text.count(chr(10))} hosts)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
