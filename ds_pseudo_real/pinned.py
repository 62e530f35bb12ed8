"""Page-locked host buffers of exactly the size asked for, and the return of torch's own pinned cache.

Owns: every pinned allocation of the offload (``host_empty``): anonymous host pages registered with the CUDA runtime
(``cudaHostRegister``, as DeepSpeed 0.19.8's ``CUDA_Accelerator.register_host_memory`` pins its native buffers) and
unregistered when the last tensor using them is freed, before the pages are unmapped. torch's ``pin_memory=True``
allocates from its caching host allocator (torch 2.x ``CachingHostAllocator``), which rounds every allocation up to a
power of two (+31 % for an M6-10T expert group) and keeps freed blocks for the process (a pseudo engine's buffers
through the real stage). Must not plan or step.
"""
from __future__ import annotations

import mmap
from typing import Sequence, Union

import torch

CUDA_SUCCESS = 0  # cudaError_t cudaSuccess


class _RegisteredPages(mmap.mmap):
    """Anonymous host pages, registered with the CUDA runtime while alive. The tensors made on them hold them (torch's
    ``frombuffer``), so ``__del__`` runs once the last tensor, view or ``Parameter.data`` using them is gone, and
    before the pages are unmapped (a subclass finalizer runs before ``mmap``'s own dealloc)."""

    address = 0  # set once registered
    cudart = None  # the runtime module that registered them

    def __del__(self):
        if self.address:
            self.cudart.cudaHostUnregister(self.address)


def host_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new host tensor of ``shape`` and ``dtype``: page-locked at its exact size (in whole pages) when ``pin``, in
    torch's CPU allocator otherwise. Pinned memory comes zeroed (fresh anonymous pages); otherwise its values are
    whatever the allocator gives."""
    size = torch.Size([shape] if isinstance(shape, int) else shape)
    numel = size.numel()
    if not pin or numel == 0:
        return torch.empty(size, dtype=dtype, device="cpu")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    pages = _RegisteredPages(-1, nbytes)
    address = torch.frombuffer(pages, dtype=torch.uint8).data_ptr()
    pages.cudart = torch.cuda.cudart()
    result = int(pages.cudart.cudaHostRegister(address, nbytes, 0))
    if result != CUDA_SUCCESS:
        raise RuntimeError(f"granular_offload.pin_memory: cudaHostRegister of {nbytes} bytes of host memory failed "
                           f"(CUDA error {result}); accepted: a host that can page-lock it, or pin_memory false "
                           f"(pageable buffers, synchronous copies)")
    pages.address = address
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(size)  # CUDA reports it pinned: ``is_pinned()``


def empty_host_cache() -> None:
    """Give the pinned blocks torch's caching host allocator keeps back to the OS (``torch._C._host_emptyCache``,
    present in CUDA builds of torch 2.x; nothing to do without it). Pinned allocations made outside this module
    (DeepSpeed's, a ``non_blocking`` copy to the host) land there and stay cached until this is called."""
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_cache is not None:
        empty_cache()
