"""Measuring, on the machine it runs on, the rates the step-time model assumes: the host Adam's parameters per
second with DeepSpeed's CPU Adam kernel on the cores one rank gets, the pinned host<->device bandwidth (on a GPU),
and the node's memory and cores.

Owns: the measurements and their JSON file (``--calibration-out`` / ``--calibration`` of ``ds-pseudo-real plan``).
Must not plan: ``offload.step_time`` models with what this measures. Written against DeepSpeed 0.19.8's cpu_adam
op (``ds_opt_adam.adam_update``, as ``offload.host_adam`` calls it) and torch 2.13.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

# Out of every cache (four fp32 tensors of 32 Mi elements: 512 MiB), a few repeats: about 0.1 s each on one core.
ADAM_NUMEL = 32 * 2**20
REPEATS = 5
COPY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Calibration:
    """What one run of :func:`calibrate` measured (None: not measured on this machine, e.g. no GPU)."""

    cpu_adam_params_per_s: float
    cpu_adam_threads: int
    cpu_share: float  # process CPU seconds over wall seconds per thread: below ~0.8 the machine was busy
    ranks_per_node: int  # the ranks the cores were shared among (threads = cores // this)
    node_memory_bytes: int
    node_cores: int
    pcie_h2d_bytes_per_s: Optional[float] = None
    pcie_d2h_bytes_per_s: Optional[float] = None
    device: str = "cpu"
    host: str = ""

    @property
    def pcie_bytes_per_s(self) -> Optional[float]:
        """The slower direction (the model uses one rate for both)."""
        if self.pcie_h2d_bytes_per_s is None or self.pcie_d2h_bytes_per_s is None:
            return None
        return min(self.pcie_h2d_bytes_per_s, self.pcie_d2h_bytes_per_s)

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """Read a file :meth:`save` wrote; ``ValueError`` naming the file and what is wrong."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--calibration: cannot read {path}: {error}") from None
        accepted = "accepted: a file written by ds-pseudo-real plan --calibrate --calibration-out"
        if not isinstance(raw, dict):
            raise ValueError(f"--calibration: {path} holds a JSON {type(raw).__name__}, not an object; {accepted}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in raw)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if missing or unknown:
            raise ValueError(f"--calibration: {path} is not a calibration file (missing keys {missing}, unknown "
                             f"keys {unknown}); {accepted}")
        return cls(**raw)


def node_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The node's memory: ``MemTotal`` of /proc/meminfo."""
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo}: no MemTotal line")


def node_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_adam_rate(threads: int, numel: int = ADAM_NUMEL, repeats: int = REPEATS,
                  progress: Callable[[str], None] = lambda line: None):
    """DeepSpeed's CPU Adam kernel on ``numel`` fp32 elements with ``threads`` OpenMP threads: (median parameters
    per second over ``repeats`` steps after a warm-up one, process CPU seconds per wall second per thread)."""
    progress("  host Adam: loading DeepSpeed's CPU Adam op, filling the buffers")
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel's ``omp parallel for`` takes torch's OpenMP thread count
    try:
        adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        param, grad, exp_avg, exp_avg_sq = (torch.rand(numel) for _ in range(4))
        walls, cpus = [], []
        for step in range(1, repeats + 2):
            wall, cpu = time.perf_counter(), time.process_time()
            adam.ds_opt_adam.adam_update(adam.opt_id, step, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, param, grad,
                                         exp_avg, exp_avg_sq)
            if step > 1:  # the first touches the moments' pages and starts the threads
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            progress(f"  host Adam, {threads} thread{'s' if threads > 1 else ''}: step {step} of {repeats + 1}")
        return numel / statistics.median(walls), sum(cpus) / sum(walls) / threads
    finally:
        torch.set_num_threads(before)


def pcie_rates(nbytes: int = COPY_BYTES, repeats: int = REPEATS):
    """Pinned host -> device and device -> host copies of ``nbytes`` on the current CUDA device: median bytes per
    second each way, or (None, None) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    from ds_pseudo_real.pinned import host_empty

    host = host_empty(nbytes, torch.uint8, pin=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(dst, src) -> float:
        times = []
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(times)

    return timed(device, host), timed(host, device)


def default_ranks_per_node() -> int:
    """One rank per GPU of this machine, one without."""
    import torch

    return max(1, torch.cuda.device_count())


def calibrate(ranks_per_node: int, numel: Optional[int] = None, repeats: int = REPEATS,
              progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
              ) -> Calibration:
    """Measure this machine for ``ranks_per_node`` ranks: the host Adam on its share of the cores, PCIe, memory."""
    import torch

    cores, memory, numel = node_cores(), node_memory_bytes(), numel or ADAM_NUMEL
    threads = max(1, cores // ranks_per_node)
    progress(f"calibrating: {cores} cores, {memory / 2**30:.1f} GiB; host Adam on {threads} thread"
             f"{'s' if threads > 1 else ''} ({cores} cores / {ranks_per_node} ranks per node), {numel:,} params")
    rate, share = cpu_adam_rate(threads, numel, repeats, progress)
    progress(f"  host Adam: {rate:.3g} params/s" + (f" (busy machine: {share:.0%} of {threads} cores' time)"
                                                     if share < 0.8 else ""))
    if torch.cuda.is_available():
        progress(f"  PCIe: pinned copies of {COPY_BYTES // 2**20} MiB each way")
        h2d, d2h = pcie_rates(repeats=repeats)
        progress(f"  PCIe: host to device {h2d / 1e9:.3g} GB/s, device to host {d2h / 1e9:.3g} GB/s")
        device = torch.cuda.get_device_name()
    else:
        progress("  PCIe: not measured (no CUDA device here); the plan keeps granular_offload.pcie_gb_per_s")
        h2d = d2h = None
        device = "cpu"
    return Calibration(rate, threads, share, ranks_per_node, memory, cores, h2d, d2h, device, socket.gethostname())
