"""The ``cuda`` backend: CUDA virtual memory management through the driver API (DESIGN §2.7).

- The device's primary context (the one torch uses) is made current in every thread that calls
  the driver, allocator callbacks included.
- Sizes are rounded to the allocation granularity by the caller; each allocation is one handle.
- Copies between device and the pinned host arena go one per allocation, round-robin on a few
  dedicated non-blocking streams, each followed by an event, so the caller can release an
  allocation the moment its own copy lands while later copies are still running. The SM path
  (copy_path.py) has streams and events of its own (cuda_copies.py).
- Host memory is pinned mapped (``DEVICEMAP``) and its device address recorded, so that SM
  kernels can read and write it (host_mappings.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dormant.memory.backend import Span
from dormant.memory.copy_path import CopyPath
from dormant.memory.cuda_copies import CudaCopies, EventPool, SmIssue
from dormant.memory.cuda_driver import call, driver
from dormant.memory.dlpack import tensor_at
from dormant.memory.host_mappings import HostMappings
from dormant.memory.sm_copy import sm_copy


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
        self._events = EventPool()
        self._sm_streams = [call("cuStreamCreate", flags) for _ in range(num_streams)]
        self._sm_events = EventPool()
        self.host_mappings = HostMappings()
        self._sm_issue = SmIssue(self.device, self.host_mappings)
        self._handles: dict[int, Any] = {}
        self._warm_up_hash()
        self._warm_up_sm_copy()

    def _warm_up_hash(self) -> None:
        """Compiles the hash kernels now (one kernel serves every span count), and makes
        torch's pinned host cache hold the buffers a hash uses, so that the first sleep is
        neither a compile (~1 s) nor a pinned allocation."""
        scratch = torch.zeros(1024, dtype=torch.int32, device=self.device)
        spans = [Span(scratch.data_ptr(), 2048), Span(scratch.data_ptr() + 2048, 2048)]
        hashes = self.hash_batch()
        hashes.wait(hashes.add(spans))

    def _warm_up_sm_copy(self) -> None:
        """Loads the SM path's kernels (uint8 and int32) now, not in the first wake that uses
        them (CUDA loads modules lazily)."""
        scratch = torch.zeros(64, dtype=torch.uint8, device=self.device)
        sm_copy(scratch.data_ptr() + 33, scratch.data_ptr() + 1, 30, self.device)
        torch.cuda.synchronize(self.device)

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

    def copy_batch(self, path: CopyPath = CopyPath.COPY_ENGINE) -> CudaCopies:
        self._ensure_context()
        if path is CopyPath.COPY_ENGINE:
            return CudaCopies(self._streams, self._events)
        if path is CopyPath.SM:
            return CudaCopies(self._sm_streams, self._sm_events, self._sm_issue)
        raise ValueError("a backend batch copies by one path; HYBRID is two (path_copies.py)")

    def _wait(self) -> None:
        for stream in self._streams:
            call("cuStreamSynchronize", stream)

    def hash_batch(self) -> _CudaHashes:
        self._ensure_context()
        return _CudaHashes(self.device)

    def pin(self, address: int, size: int) -> None:
        """Registers the range portable and mapped, and records its device address (on the
        H200 the host address itself). All or nothing."""
        self._ensure_context()
        cu = driver()
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        call("cuMemHostRegister", address, size, flags)
        try:
            device = int(call("cuMemHostGetDevicePointer", address, 0))
            self.host_mappings.add(address, size, device)
        except BaseException:
            call("cuMemHostUnregister", address)
            raise

    def unpin(self, address: int, size: int) -> None:
        self._ensure_context()
        call("cuMemHostUnregister", address)
        self.host_mappings.remove(address)


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
