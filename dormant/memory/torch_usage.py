"""What torch's CUDA caching allocator holds outside dormant's tags, and giving it back.

Measured, never estimated:

- **Outside the tags.** ``torch.cuda.memory_allocated()`` and ``memory_reserved()`` count every
  pool, the tags' capture and graph pools included (their segments are ``raw_alloc`` blocks of
  the manager, which sleep with their tag while torch still counts them). So the figures here
  come from torch's segment snapshot, leaving out every segment whose address is a live raw
  block of the manager: ``allocated`` sums the live blocks of the other segments (tensors that
  no sleep can free), ``reserved`` their whole size (the rest is cached, reserved but unused).
- **cuBLAS workspaces.** torch gives each (cuBLAS handle, stream) pair it has run a GEMM on a
  workspace from the caching allocator (32 MiB on Hopper, ``CUBLAS_WORKSPACE_CONFIG``), kept
  until ``torch._C._cuda_clearCublasWorkspaces()``. ``release_torch_memory`` clears them and
  measures the bytes as the drop in ``memory_allocated()`` across the clear: exactly what they
  held. They come back on the next GEMM, from the caching allocator.
- **Cached blocks.** ``torch.cuda.empty_cache()`` returns every unused segment outside the
  tags' pools; the bytes are the drop in ``memory_reserved()``.

Clearing the workspaces is safe between steps: every cuBLAS call through torch sets its
handle's workspace again first, and a freed workspace is reused only in stream order. A graph
captured while its stream had no workspace allocated its own from the graph's pool (which is why
``DecodeGraphs`` clears them before capturing, as torch's inductor does): clearing frees it into
that pool, where the graph's replays keep using it, as they use every other block of the pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TorchUsage:
    """torch's caching allocator outside every tag, on one device."""

    allocated_bytes: int  # live blocks: tensors, cuBLAS workspaces
    reserved_bytes: int  # the segments holding them, with their cached free space

    @property
    def cached_bytes(self) -> int:
        """Reserved but unused: what ``empty_cache()`` could return (whole free segments)."""
        return self.reserved_bytes - self.allocated_bytes


@dataclass(frozen=True)
class TorchRelease:
    """What one ``release_torch_memory`` gave back."""

    cublas_workspace_bytes: int  # live workspaces freed (then returned with the cache)
    cache_bytes: int  # reserved bytes empty_cache returned to the driver
    seconds: float


def torch_outside_tags(device: torch.device, tag_segments: Iterable[int]) -> TorchUsage:
    """torch's allocated and reserved bytes on ``device``, leaving out the segments at
    ``tag_segments`` (the manager's raw blocks). Zero on a device that is not CUDA."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return TorchUsage(0, 0)
    skip = set(tag_segments)
    index = device.index if device.index is not None else torch.cuda.current_device()
    allocated = reserved = 0
    for segment in _segments():
        if segment.get("device", index) != index or segment["address"] in skip:
            continue
        allocated += int(segment["allocated_size"])
        reserved += int(segment["total_size"])
    return TorchUsage(allocated, reserved)


def _segments() -> list[dict[str, Any]]:
    try:
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch without the include_traces argument
        return torch.cuda.memory_snapshot()


def clear_cublas_workspaces() -> bool:
    """Frees torch's cuBLAS/cuBLASLt workspaces (they are re-created on the next GEMM).
    Returns False where torch has no such call (a build without CUDA)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def release_torch_memory(device: torch.device) -> TorchRelease | None:
    """Synchronizes ``device``, frees the cuBLAS workspaces and returns torch's unused cached
    segments to the driver; measures both (see the module docstring). None off CUDA.

    Precondition: nothing runs on the device that could be mid-GEMM (between steps, after the
    manager's sleep synchronized it).
    """
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    allocated = torch.cuda.memory_allocated(device)
    clear_cublas_workspaces()
    workspaces = allocated - torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    cache = reserved - torch.cuda.memory_reserved(device)
    return TorchRelease(workspaces, cache, time.perf_counter() - start)
