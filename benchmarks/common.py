"""Shared plumbing of the benchmarks: one single-rank DeepSpeed process, clocks, curve arithmetic and statistics.

Owns: the single-process distributed setup, the timing helpers, and the pure arithmetic every benchmark reports
with (cost-model clocks, steps/time to a target loss, values at equal time, spread, paired differences; tested in
tests/test_benchmarks.py). Must not change the plugin: benchmarks only call its public functions.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

RESULTS = Path(__file__).resolve().parent / "results"


# ---- process setup ---------------------------------------------------------------------------------------------
def init_single_process(threads: Optional[int] = None) -> None:
    """One DeepSpeed rank on this host (gloo), with ``threads`` torch threads when given."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if "RANK" not in os.environ:
        from ds_pseudo_real.ports import rendezvous_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(rendezvous_port()))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit hosts
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX = -1, -3, 32 * 2**20


def keep_freed_blocks() -> bool:
    """Make the CPU, standing in for the device, keep the memory freed tensors give back, as CUDA's caching allocator
    keeps freed device blocks: glibc malloc serves blocks under 32 MiB from its heap and never trims it. Without
    this, every tensor of a few MiB (a fetched layer's parameters, a fresh weight gradient) is a new ``mmap`` whose
    pages fault in on first write: measured here, refilling two released 4 MiB buffers took 4.3 ms against 0.16 ms
    for the copies alone. Returns False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def machine_description() -> Dict[str, object]:
    """What the figures were measured on (they are ratios from one run: the machine matters, not the absolute)."""
    import torch

    commit = os.environ.get("BENCHMARK_COMMIT", "")  # set when running from an exported snapshot of a commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=Path(__file__).parent).stdout.strip()
            commit += " + uncommitted changes" if dirty else ""
        except OSError:
            commit = ""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_at_start": load,
        "commit": commit,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def write_json(path: Path, payload: Mapping) -> Path:
    """``payload`` as JSON, gzipped when ``path`` ends in .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, sort_keys=False) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))  # mtime 0: the same payload gives the same bytes
    else:
        path.write_text(text)
    return path


def read_json(path: Path) -> Dict:
    """What ``write_json`` wrote to ``path``, gzipped or not."""
    path = Path(path)
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


# ---- timing ----------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> Tuple[object, float]:
    """``fn()`` and its wall time in seconds (``sync`` waits for the device before each clock read)."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(engine, x, y):
    """One training step of ``engine`` on ``(x, y)``: (loss, forward+backward seconds, optimizer step seconds), each
    part ending when its device work does."""
    cuda_sync()
    start = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    cuda_sync()
    middle = time.perf_counter()
    engine.step()
    cuda_sync()
    return loss, middle - start, time.perf_counter() - middle


# ---- clocks and curves (pure) ----------------------------------------------------------------------------------
def cumulative(values: Sequence[float]) -> List[float]:
    """Running sums: element i is the total after i + 1 steps."""
    out, total = [], 0.0
    for value in values:
        total += value
        out.append(total)
    return out


def cost_model_clock(phases: Sequence[str], step_cost: Mapping[str, float]) -> List[float]:
    """The deterministic clock: after step i, the sum of ``step_cost[phase]`` over the phases of steps 1..i+1.

    ``phases[i]`` names what step i + 1 ran (``"pseudo"``, ``"real"``, ...); ``step_cost`` the seconds one such
    step is charged (a median of measured step times, or a predicted cost).
    """
    missing = sorted(set(phases) - set(step_cost))
    if missing:
        raise KeyError(f"no step cost for phases {missing}; have {sorted(step_cost)}")
    return cumulative([step_cost[p] for p in phases])


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> Optional[float]:
    """The first x at which the curve reaches ``target`` (y <= target), linearly interpolated between the last
    point above and the first point at or below it; None when it never does. ``xs`` must increase."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} vs {len(ys)})")
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= target:
            if i == 0:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return float(x0 + (x - x0) * (y0 - target) / (y0 - y))
    return None


def value_at(xs: Sequence[float], ys: Sequence[float], x: float) -> Tuple[float, bool]:
    """The curve's value at ``x`` by linear interpolation, and whether the curve ended before ``x`` (then its
    last value is returned). Before the first point the first value is returned."""
    if not xs:
        raise ValueError("empty curve")
    if x >= xs[-1]:
        return float(ys[-1]), x > xs[-1]
    if x <= xs[0]:
        return float(ys[0]), False
    for i in range(1, len(xs)):
        if xs[i] >= x:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)), False
    raise AssertionError("unreachable")


# ---- statistics (pure) -----------------------------------------------------------------------------------------
def spread(values: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """Mean, sample standard deviation, min, max and count of the values that are not None, and the median over all
    of them with a None counting as infinitely large (a seed that never reached a target: ``median_all``, None when
    that median is infinite)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "missing": len(values),
                "median_all": None}
    return {
        "mean": statistics.fmean(present),
        "std": statistics.stdev(present) if len(present) > 1 else 0.0,
        "min": min(present),
        "max": max(present),
        "n": len(present),
        "missing": len(values) - len(present),
        "median_all": median_counting_missing(values),
    }


def median_counting_missing(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of ``values`` with every None counted as +infinity; None when the median itself is infinite."""
    ordered = sorted(float(v) for v in values if v is not None) + [math.inf] * sum(v is None for v in values)
    if not ordered:
        return None
    middle = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    return None if math.isinf(middle) else middle


def paired_differences(arm: Mapping[int, Optional[float]], baseline: Mapping[int, Optional[float]]) -> Dict[str, object]:
    """``arm[seed] - baseline[seed]`` for the seeds both have, with their spread, how many are below zero, the
    paired t statistic (mean / standard error; None below 2 seeds or with no spread) and the two-sided sign-test
    p-value (``sign_test_p``)."""
    seeds = sorted(s for s in arm if s in baseline and arm[s] is not None and baseline[s] is not None)
    diffs = [float(arm[s]) - float(baseline[s]) for s in seeds]
    out: Dict[str, object] = {"seeds": seeds, "differences": diffs, **spread(diffs)}
    out["negative"] = sum(d < 0 for d in diffs)
    out["t"] = out["mean"] / (out["std"] / math.sqrt(len(diffs))) if len(diffs) > 1 and out["std"] else None
    out["sign_p"] = sign_test_p(out["negative"], sum(d > 0 for d in diffs))
    return out


def sign_test_p(below: int, above: int) -> Optional[float]:
    """Two-sided exact sign test: the chance, if each nonzero difference were below zero with probability 1/2, of
    a split at least as uneven as ``below`` : ``above`` (ties are left out before counting). None for no pairs."""
    n = below + above
    if n == 0:
        return None
    tail = sum(math.comb(n, i) for i in range(min(below, above) + 1)) / 2**n
    return min(1.0, 2 * tail)


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def fmt(value: Optional[float], digits: int = 3, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the memory-bound model: an M6-style expert-prototyping MoE GPT ---------------------------------------------
def _moe_classes():
    """Built lazily so that the pure helpers above import without torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ds_pseudo_real.models.gpt import GPT, CausalSelfAttention
    from ds_pseudo_real.moe import routing

    class PrototypedMoE(nn.Module):
        """M6 expert prototyping: ``num_experts`` experts in ``num_prototypes`` groups, top-1 inside each group,
        the k gated outputs summed; each expert takes at most ``capacity_factor`` x its fair share of tokens.
        Routing math is ``ds_pseudo_real.moe.routing``'s; experts are batched as [E, capacity, d] matmuls."""

        def __init__(self, d_model: int, ffn: int, num_experts: int, num_prototypes: int, capacity_factor: float):
            super().__init__()
            routing.check_prototypes(num_experts, num_prototypes)
            self.num_experts, self.num_prototypes, self.capacity_factor = num_experts, num_prototypes, capacity_factor
            self.router = nn.Linear(d_model, num_experts, bias=False)
            self.w1 = nn.Parameter(torch.empty(num_experts, d_model, ffn))
            self.w2 = nn.Parameter(torch.empty(num_experts, ffn, d_model))
            self.balance_loss: Optional[torch.Tensor] = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape, d = x.shape, x.shape[-1]
            x = x.reshape(-1, d)
            tokens, experts = x.shape[0], self.num_experts
            logits = self.router(x)
            gates, routed = routing.expert_prototype_routing(logits, self.num_prototypes)
            self.balance_loss = routing.load_balancing_loss(logits, routed, self.num_prototypes) if self.training else None
            capacity = routing.expert_capacity(tokens, experts, self.num_prototypes, self.capacity_factor)
            gates, routed = routing.drop_over_capacity(gates, routed, capacity)
            token, expert = routed.nonzero(as_tuple=True)
            slot = (torch.cumsum(routed.long(), dim=0) - 1)[token, expert]
            position = expert * capacity + slot
            buffer = x.new_zeros(experts * capacity, d).index_copy(0, position, x[token])
            hidden = F.gelu(torch.bmm(buffer.view(experts, capacity, d), self.w1))
            out = torch.bmm(hidden, self.w2).view(experts * capacity, d)[position] * gates[token, expert].unsqueeze(1)
            return x.new_zeros(tokens, d).index_add(0, token, out).view(shape)

    class MoEBlock(nn.Module):
        def __init__(self, cfg, moe: "PrototypedMoE"):
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg.d_model)
            self.attn = CausalSelfAttention(cfg)
            self.ln2 = nn.LayerNorm(cfg.d_model)
            self.moe = moe

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.moe(self.ln2(x))

    class M6MoEGPT(GPT):
        """The demo GPT with every block's MLP an M6 expert-prototyping MoE; the training loss adds
        ``balance_coeff`` x the mean per-prototype balance loss (validation reports the language-model loss only)."""

        def __init__(self, cfg, num_experts: int, num_prototypes: int, ffn: int, capacity_factor: float = 1.25,
                     balance_coeff: float = 0.01):
            super().__init__(cfg)
            self.balance_coeff = balance_coeff
            self.layers = nn.ModuleList(
                MoEBlock(cfg, PrototypedMoE(cfg.d_model, ffn, num_experts, num_prototypes, capacity_factor))
                for _ in range(cfg.n_layer)
            )
            self.apply(self._init)
            for name, param in self.named_parameters():
                if name.endswith(("attn.proj.weight", "moe.w2")):
                    nn.init.normal_(param, std=0.02 / (2 * cfg.n_layer) ** 0.5)
                elif name.endswith("moe.w1"):
                    nn.init.normal_(param, std=0.02)

        def forward(self, idx, targets=None):
            out = super().forward(idx, targets)
            if targets is None or not self.training or not self.balance_coeff:
                return out
            balance = [layer.moe.balance_loss for layer in self.layers]
            return out + self.balance_coeff * torch.stack(balance).mean()

    return PrototypedMoE, M6MoEGPT


def build_gpt(n_layer: int, d_model: int, n_head: int, seq_len: int, moe: Optional[Mapping[str, float]] = None):
    """The demo GPT (``ds_pseudo_real.models``), or with ``moe`` every block's MLP replaced by an M6 expert-prototyping
    MoE (keys: num_experts, num_prototypes, ffn, capacity_factor, balance_coeff)."""
    from ds_pseudo_real.models import GPT, GPTConfig

    cfg = GPTConfig(seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=n_head)
    if moe is None:
        return GPT(cfg)
    return _moe_classes()[1](cfg, **moe)
