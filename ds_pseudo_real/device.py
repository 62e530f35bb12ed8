"""The device this rank computes and communicates on, decided in one place: DeepSpeed's accelerator device numbered
``LOCAL_RANK`` (what DeepSpeed's engine picks), made current before anything touches the accelerator.

Owns: which device a rank uses and making it current. Must not allocate. Written against DeepSpeed 0.19.8, whose
engine calls ``set_device(local_rank)`` only inside ``deepspeed.initialize``: whatever a rank creates before that
(the offload plan's host store and streams, NCCL's communicator at ``init_distributed``, an object collective)
would otherwise land on device 0 on every rank.
"""
from __future__ import annotations

import os

import torch
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
