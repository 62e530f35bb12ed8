"""The one class-level patch: DeepSpeedEngine._broadcast_model sends host tensors through the device under NCCL.
Reversible and idempotent; touches no other method and no engine instance (DeepSpeed 0.19.8)."""
from __future__ import annotations

import functools
from typing import Callable, Dict

import torch

from .guard import check_places


# One staging buffer when a host tensor is broadcast through the device: NCCL takes device tensors only, and a
# whole host_params layer on the device at once is what the offload plan avoids.
HOST_BROADCAST_CHUNK_BYTES = 64 << 20
_UNROUTED: Dict[str, Callable] = {}  # DeepSpeed's own methods while route_host_broadcasts is in place


def broadcast_through_device(broadcast: Callable, tensor: torch.Tensor, src: int, group=None, async_op=False,
                             **kwargs):
    """``broadcast(tensor, src, group)`` (deepspeed.comm's), except that a host tensor under the NCCL backend goes
    through a staging buffer on the accelerator's device, :data:`HOST_BROADCAST_CHUNK_BYTES` at a time; that route is
    synchronous whatever ``async_op`` says (returns None). A backend serving host tensors itself
    (``cpu:gloo,cuda:nccl``, gloo) gets the tensor as it is."""
    if tensor.device.type != "cpu" or str(torch.distributed.get_backend(group)) != "nccl":
        return broadcast(tensor, src, group=group, async_op=async_op, **kwargs)
    from deepspeed.accelerator import get_accelerator

    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    step = max(1, HOST_BROADCAST_CHUNK_BYTES // flat.element_size())
    staging = torch.empty(min(step, flat.numel()), dtype=flat.dtype, device=get_accelerator().current_device_name())
    receives = torch.distributed.get_rank() != src
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step]
        buffer = staging[:piece.numel()]
        buffer.copy_(piece)
        broadcast(buffer, src, group=group, **kwargs)
        if receives:
            piece.copy_(buffer)
    if receives and work is not tensor:
        tensor.copy_(work)
    return None


def _broadcast_model_through_device(engine) -> None:
    """DeepSpeed's ``_broadcast_model`` with its ``deepspeed.comm.broadcast`` calls routed by
    :func:`broadcast_through_device` (DeepSpeed 0.19.8 engine.py calls it as ``dist.broadcast``, ``dist`` being
    ``deepspeed.comm``)."""
    from deepspeed import comm

    plain = comm.broadcast
    comm.broadcast = functools.partial(broadcast_through_device, plain)
    try:
        _UNROUTED["_broadcast_model"](engine)
    finally:
        comm.broadcast = plain


def route_host_broadcasts() -> None:
    """Make ``DeepSpeedEngine._broadcast_model`` (rank 0's model to the others, at initialize) send host tensors
    through the device when the backend is NCCL, which refuses them. Idempotent; nothing changes for device
    tensors or other backends. Raises RuntimeError naming the method when this DeepSpeed has none."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if "_broadcast_model" in _UNROUTED:
        return
    check_places("granular_offload host_params", {"DeepSpeedEngine": DeepSpeedEngine})
    _UNROUTED["_broadcast_model"] = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = _broadcast_model_through_device


def unroute_host_broadcasts() -> None:
    """Put DeepSpeed's own ``_broadcast_model`` back (undoes :func:`route_host_broadcasts`)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if "_broadcast_model" in _UNROUTED:
        DeepSpeedEngine._broadcast_model = _UNROUTED.pop("_broadcast_model")
