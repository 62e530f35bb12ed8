"""The device this rank computes and communicates on, decided in one place: DeepSpeed's accelerator device numbered
``LOCAL_RANK`` (what DeepSpeed's engine picks), made current before anything touches the accelerator; and how long
its collectives wait for the other ranks.

Owns: which device a rank uses and making it current, the timeout of its process groups. Must not allocate. Written
against DeepSpeed 0.19.8, whose engine calls ``set_device(local_rank)`` only inside ``deepspeed.initialize``: whatever
a rank creates before that (the offload plan's host store and streams, NCCL's communicator at ``init_distributed``,
an object collective) would otherwise land on device 0 on every rank.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed.distributed_c10d as c10d
from deepspeed import constants
from deepspeed.accelerator import get_accelerator


def rank_device() -> torch.device:
    """This rank's device: the accelerator's device ``LOCAL_RANK``, the CPU on a CPU run."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator.device_name(int(os.environ.get("LOCAL_RANK", "0"))))


def use_rank_device() -> torch.device:
    """Make :func:`rank_device` the current device (as DeepSpeed's engine will) and return it; call it before
    anything creates an accelerator tensor, stream or communicator."""
    device = rank_device()
    if device.type != "cpu":
        get_accelerator().set_device(device.index)
    return device


def use_collective_timeout(timeout: Optional[timedelta] = None) -> timedelta:
    """Give every process group this rank creates from now on ``timeout`` (default: DeepSpeed's, ``DEEPSPEED_TIMEOUT``
    minutes, 10 unset), not only the world group ``deepspeed.init_distributed`` makes: a collective that waits longer
    fails the rank. Call it before ``init_distributed``. Written against torch 2.13, whose ``new_group`` without a
    timeout (how DeepSpeed 0.19.8 makes its groups, ZeRO's data-parallel group a clone of the world) takes
    ``distributed_c10d.default_pg_timeout`` (30 minutes; gloo) or ``default_pg_nccl_timeout`` (10 minutes; NCCL)."""
    timeout = constants.default_pg_timeout if timeout is None else timeout
    c10d.default_pg_timeout = timeout
    if isinstance(c10d.default_pg_nccl_timeout, timedelta):  # None without NCCL support
        c10d.default_pg_nccl_timeout = timeout
    return timeout
