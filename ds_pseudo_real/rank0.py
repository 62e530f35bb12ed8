"""What rank 0 alone says: whether this process is rank 0 (or the only one) and the plugin's log lines from it.

Owns: the rank-0 test. Must not touch models, engines or files; the lines go through ``logs`` (rank 0 at INFO).
"""
from __future__ import annotations

import torch.distributed as dist

from .logs import logger


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    """An INFO line of the plugin's logger: shown by rank 0 (by every rank with ``DS_PSEUDO_REAL_LOG_ALL_RANKS``)."""
    logger.info(message)
