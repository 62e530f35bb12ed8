"""What rank 0 alone says: whether this process is rank 0 (or the only one) and the plugin's log lines from it.

Owns: the rank-0 test and the log line's prefix. Must not touch models, engines or files.
"""
from __future__ import annotations

import torch.distributed as dist


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(message: str) -> None:
    if is_rank0():
        print(f"[ds_pseudo_real] {message}", flush=True)
