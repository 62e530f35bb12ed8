"""Derive torch.distributed's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) from the
variables SLURM gives each task. Plain functions over plain data; running a command is the only side effect here
(``python -m launch.dist_env -- CMD ...`` sets the variables and execs CMD, once per srun task).

Written against SLURM 22.05's task environment (srun sets SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS,
SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_JOB_ID).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

# Deterministic rendezvous port: below Linux's ephemeral range (32768-60999) so that no outgoing connection holds
# it, spread over the job id so that two jobs sharing a first node do not collide unless their ids are 10000 apart.
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


def split_top_level(text: str, sep: str = ",") -> List[str]:
    """Split ``text`` on ``sep`` outside square brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"nodelist {text!r}: ']' at position {i} closes no '['")
        elif char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"nodelist {text!r}: a '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, nodelist: str) -> List[str]:
    """``001-004,010`` -> ``['001', ..., '004', '010']``, keeping the zero padding of the lower bound."""
    values = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ValueError(f"nodelist {nodelist!r}: {item!r} inside [...] is not N or N-M (decimal numbers)")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"nodelist {nodelist!r}: range {item!r} runs backwards")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM hostlist expression into host names, in SLURM's order, as ``scontrol show hostnames`` does.

    ``gpu[001-004,010]`` -> gpu001 .. gpu004, gpu010; ``a[1-2]-ib[0-1],login`` -> a1-ib0, a1-ib1, a2-ib0, a2-ib1, login.
    """
    hosts: List[str] = []
    for expression in split_top_level(nodelist.strip()):
        expression = expression.strip()
        if not expression:
            continue
        if "[" in expression and not expression.endswith("]"):
            # SLURM's own parser refuses text after the last [...] group (`scontrol show hostnames n[1-2]x` fails).
            raise ValueError(f"nodelist {nodelist!r}: {expression!r} has text after its last [...] group, "
                             "which SLURM does not accept")
        # Each [...] group multiplies the names built so far (left to right, the leftmost group varies slowest).
        names = [""]
        for literal, bracket in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", expression):
            if bracket:
                names = [name + literal + value for name in names for value in _expand_range_set(bracket, nodelist)]
            elif literal:
                names = [name + literal for name in names]
        hosts.extend(names)
    if not hosts:
        raise ValueError(f"nodelist {nodelist!r} names no host")
    return hosts


def parse_tasks_per_node(value: str) -> List[int]:
    """Expand SLURM's compressed per-node counts: ``8(x3),7`` -> ``[8, 8, 8, 7]`` (SLURM_STEP_TASKS_PER_NODE)."""
    counts: List[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"tasks-per-node value {value!r}: {item!r} is not N or N(xK)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def master_port_for_job(job_id: int | str) -> int:
    """The rendezvous port every rank of job ``job_id`` computes alike (a requeued job keeps its id and its port)."""
    text = str(job_id).strip()
    if not text.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r}: expected a decimal job id")
    return MASTER_PORT_BASE + int(text) % MASTER_PORT_SPAN


def first_host_from_scontrol(nodelist: str) -> str:
    """First host of ``nodelist`` as SLURM itself expands it; the pure-Python parser when scontrol is absent."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return expand_nodelist(nodelist)[0]
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    hosts = out.stdout.split()
    if not hosts:
        raise ValueError(f"`scontrol show hostnames {nodelist}` printed no host")
    return hosts[0]


@dataclass(frozen=True)
class DistEnv:
    """What one rank needs to join the job's process group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int

    def as_environ(self) -> Dict[str, str]:
        """The variables torch.distributed's ``env://`` and DeepSpeed read (GROUP_RANK is torchrun's NODE_RANK)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _int_var(environ: Mapping[str, str], name: str) -> int:
    if name not in environ:
        raise KeyError(f"{name} is not set: run this inside an srun task (srun sets SLURM_PROCID, SLURM_LOCALID, ...)")
    value = environ[name]
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    return int(value)


def from_slurm(environ: Mapping[str, str], first_host: Callable[[str], str] = lambda nl: expand_nodelist(nl)[0]
               ) -> DistEnv:
    """Derive one task's DistEnv from its SLURM variables.

    Rank 0 is SLURM task 0, which runs on the first node of the step, so MASTER_ADDR is that node: the step's
    nodelist when srun set one (it equals the job's when srun spans the whole allocation, as our sbatch script does),
    else SLURM_JOB_NODELIST. ``first_host`` expands the nodelist (``first_host_from_scontrol`` inside a real job).
    """
    rank = _int_var(environ, "SLURM_PROCID")
    local_rank = _int_var(environ, "SLURM_LOCALID")
    node_rank = _int_var(environ, "SLURM_NODEID")
    world_size = _int_var(environ, "SLURM_NTASKS")
    nodelist_var = "SLURM_STEP_NODELIST" if environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    if not environ.get(nodelist_var):
        raise KeyError("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set: run this inside a SLURM job")
    nodelist = environ[nodelist_var]
    per_node_var = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    if not environ.get(per_node_var):
        raise KeyError("neither SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set: run this inside srun")
    per_node = parse_tasks_per_node(environ[per_node_var])
    if node_rank >= len(per_node):
        raise ValueError(f"SLURM_NODEID={node_rank} but {per_node_var}={environ[per_node_var]!r} "
                         f"lists {len(per_node)} node(s)")
    if sum(per_node) != world_size:
        raise ValueError(f"{per_node_var}={environ[per_node_var]!r} sums to {sum(per_node)} tasks, "
                         f"SLURM_NTASKS={world_size}")
    if not rank < world_size:
        raise ValueError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}")
    if not local_rank < per_node[node_rank]:
        raise ValueError(f"SLURM_LOCALID={local_rank} is not below this node's {per_node[node_rank]} tasks "
                         f"({per_node_var}={environ[per_node_var]!r}, SLURM_NODEID={node_rank})")
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=per_node[node_rank],
        node_rank=node_rank,
        num_nodes=len(per_node),
        master_addr=first_host(nodelist),
        master_port=master_port_for_job(environ.get("SLURM_JOB_ID", "")),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m launch.dist_env -- CMD ...``: export this srun task's torch.distributed variables, exec CMD."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m launch.dist_env -- COMMAND [ARGS ...]   (inside an srun task)", file=sys.stderr)
        return 2
    env = from_slurm(os.environ, first_host=first_host_from_scontrol)
    # The host, so that a multi-node job's rank logs say where each rank ran.
    print(f"dist_env: rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
          f"node {env.node_rank}/{env.num_nodes} master {env.master_addr}:{env.master_port} on host "
          f"{os.uname().nodename}", file=sys.stderr, flush=True)
    os.environ.update(env.as_environ())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())
