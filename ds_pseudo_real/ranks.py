"""This process among the ranks: which one it is, the object collectives and barriers every part of the plugin uses
to agree (no-ops in a single process), and the lines rank 0 alone says.

Owns: those few calls. Must not touch models, engines or files; the lines go through ``logs`` (rank 0 at INFO).
"""
from __future__ import annotations

from typing import Any, List, Tuple

from .logs import logger


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> Tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def is_rank0() -> bool:
    return rank_and_world()[0] == 0


def gather(obj: Any) -> List[Any]:
    """``obj`` of every rank, in rank order (collective; NCCL's object collectives run on the current device)."""
    dist = _dist()
    if dist is None:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def log_rank0(message: str) -> None:
    """An INFO line of the plugin's logger: shown by rank 0 (by every rank with ``DS_PSEUDO_REAL_LOG_ALL_RANKS``)."""
    logger.info(message)
