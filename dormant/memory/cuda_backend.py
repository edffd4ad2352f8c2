"""The ``cuda`` backend: CUDA virtual memory management through the driver API (DESIGN §2.7).

- The device's primary context (the one torch uses) is made current in every thread that calls
  the driver, allocator callbacks included.
- Sizes are rounded to the allocation granularity by the caller; each allocation is one handle.
- Copies between device and the pinned host arena go one per allocation, round-robin on a few
  dedicated non-blocking streams, each followed by an event, so the caller can release an
  allocation the moment its own copy lands while later copies are still running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dormant.memory.backend import Copy, Span
from dormant.memory.cuda_driver import call, driver
from dormant.memory.dlpack import tensor_at


class CudaBackend:
    name = "cuda"

    def __init__(self, index: int, num_streams: int = 2) -> None:
        cu = driver()
        call("cuInit", 0)
        self.index = index
        self.device = torch.device("cuda", index)
        self.device_key = f"cuda:{index}"
        self._cu_device = call("cuDeviceGet", index)
        self._context = call("cuDevicePrimaryCtxRetain", self._cu_device)
        self._local = threading.local()
        self._ensure_context()

        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(call("cuMemGetAllocationGranularity", prop, minimum))

        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        self._streams = [call("cuStreamCreate", flags) for _ in range(num_streams)]
        self._events = _EventPool()
        self._handles: dict[int, Any] = {}
        self._warm_up_hash()

    def _warm_up_hash(self) -> None:
        """Compiles the hash kernels now (one kernel serves every span count), and makes
        torch's pinned host cache hold the buffers a hash uses, so that the first sleep is
        neither a compile (~1 s) nor a pinned allocation."""
        scratch = torch.zeros(1024, dtype=torch.int32, device=self.device)
        spans = [Span(scratch.data_ptr(), 2048), Span(scratch.data_ptr() + 2048, 2048)]
        hashes = self.hash_batch()
        hashes.wait(hashes.add(spans))

    def _ensure_context(self) -> None:
        if not getattr(self._local, "has_context", False):
            call("cuCtxSetCurrent", self._context)
            self._local.has_context = True

    def reserve(self, size: int) -> int:
        self._ensure_context()
        return int(call("cuMemAddressReserve", size, self.granularity, 0, 0))

    def free_reservation(self, va: int, size: int) -> None:
        self._ensure_context()
        call("cuMemAddressFree", va, size)

    def create(self, size: int) -> int:
        self._ensure_context()
        handle = call("cuMemCreate", size, self._prop, 0, nbytes=size)
        key = int(handle)
        self._handles[key] = handle
        return key

    def map(self, va: int, size: int, handle: int) -> None:
        self._ensure_context()
        call("cuMemMap", va, size, 0, self._handles[handle], 0)
        try:
            call("cuMemSetAccess", va, size, [self._access], 1)
        except BaseException:
            call("cuMemUnmap", va, size)
            raise

    def unmap(self, va: int, size: int) -> None:
        self._ensure_context()
        call("cuMemUnmap", va, size)

    def release(self, handle: int) -> None:
        self._ensure_context()
        call("cuMemRelease", self._handles[handle])
        del self._handles[handle]  # only once released: a failed release keeps the handle

    def memory_info(self) -> tuple[int, int]:
        self._ensure_context()
        free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def other_usage(self) -> dict[str, int]:
        return {"torch caching allocator": torch.cuda.memory_reserved(self.index)}

    def synchronize(self) -> None:
        self._ensure_context()
        call("cuCtxSynchronize")

    def view(self, va: int, nbytes: int, on_free: Callable[[], None]) -> torch.Tensor:
        return tensor_at(va, nbytes, self.device, on_free)

    def fill(self, spans: Sequence[Span], value: int) -> None:
        self._ensure_context()
        for i, span in enumerate(spans):
            call(
                "cuMemsetD8Async",
                span.address,
                value,
                span.nbytes,
                self._streams[i % len(self._streams)],
            )
        self._wait()

    def copy_batch(self) -> _CudaCopies:
        self._ensure_context()
        return _CudaCopies(self._streams, self._events)

    def _wait(self) -> None:
        for stream in self._streams:
            call("cuStreamSynchronize", stream)

    def hash_batch(self) -> _CudaHashes:
        self._ensure_context()
        return _CudaHashes(self.device)

    def pin(self, address: int, size: int) -> None:
        self._ensure_context()
        portable = driver().CU_MEMHOSTREGISTER_PORTABLE
        call("cuMemHostRegister", address, size, portable)

    def unpin(self, address: int, size: int) -> None:
        self._ensure_context()
        call("cuMemHostUnregister", address)


class _CudaHashes:
    """Each group is hashed by two kernel launches on torch's current stream; its digests come
    back through a pinned buffer guarded by an event (cuda_hash.start_hashes)."""

    def __init__(self, device: torch.device) -> None:
        from dormant.memory.cuda_hash import PendingHashes

        self._device = device
        self._groups: list[PendingHashes] = []

    def add(self, spans: Sequence[Span]) -> int:
        from dormant.memory.cuda_hash import start_hashes

        self._groups.append(start_hashes(spans, self._device))
        return len(self._groups) - 1

    def wait(self, index: int) -> list[bytes]:
        return self._groups[index].result()


class _EventPool:
    """Reusable CUDA events (timing disabled). Events are handed out in order from index 0 for
    each batch; a batch is always waited for completely before the next one starts."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def get(self, index: int) -> Any:
        while len(self._events) <= index:
            flags = driver().CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._events.append(call("cuEventCreate", flags))
        return self._events[index]


class _CudaCopies:
    """One ``cuMemcpyAsync`` per copy (unified addressing picks the direction).

    Copies go in groups of at least ``GROUP_BYTES`` on one stream, each group closed by an event,
    and groups go round-robin over the streams. Large copies are a group each; thousands of small
    ones share an event per group, which keeps the driver calls per copy down to one.
    """

    GROUP_BYTES = 64 << 20

    def __init__(self, streams: list[Any], events: _EventPool) -> None:
        self._streams = streams
        self._events = events
        self._group_of: list[int] = []  # copy index -> group index
        self._num_closed = 0
        self._open_bytes = 0
        self._is_synced: list[bool] = []

    def _stream(self) -> Any:
        return self._streams[self._num_closed % len(self._streams)]

    def add(self, copy: Copy) -> int:
        call("cuMemcpyAsync", copy.dst, copy.src, copy.nbytes, self._stream())
        self._group_of.append(self._num_closed)
        self._open_bytes += copy.nbytes
        if self._open_bytes >= self.GROUP_BYTES:
            self._close_group()
        return len(self._group_of) - 1

    def _close_group(self) -> None:
        call("cuEventRecord", self._events.get(self._num_closed), self._stream())
        self._is_synced.append(False)
        self._num_closed += 1
        self._open_bytes = 0

    def wait(self, index: int) -> None:
        group = self._group_of[index]
        if group == self._num_closed:  # the copy's group is still open
            self._close_group()
        if not self._is_synced[group]:
            call("cuEventSynchronize", self._events.get(group))
            self._is_synced[group] = True

    def wait_all(self) -> None:
        """Synchronizes the streams this batch used: none for a batch with no copy, so a sleep
        or wake that only releases or maps makes no call here."""
        has_open_group = bool(self._group_of) and self._group_of[-1] == self._num_closed
        num_groups = self._num_closed + has_open_group
        for stream in self._streams[: min(num_groups, len(self._streams))]:
            call("cuStreamSynchronize", stream)
