"""The ``cuda`` backend: CUDA virtual memory management through the driver API (DESIGN §2.7).

- The device's primary context (the one torch uses) is made current in every thread that calls
  the driver, allocator callbacks included.
- Sizes are rounded to the allocation granularity by the caller; each allocation is one handle.
- Copies between device and the pinned host arena are split into chunks issued round-robin on a
  few dedicated non-blocking streams, then waited for.
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

    def __init__(self, index: int, num_streams: int = 2, chunk_bytes: int = 64 << 20) -> None:
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
        self.chunk_bytes = chunk_bytes
        self._handles: dict[int, Any] = {}

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
        call("cuMemRelease", self._handles.pop(handle))

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

    def copy_to_host(self, copies: Sequence[Copy]) -> None:
        self._copy(copies, "cuMemcpyDtoHAsync")

    def copy_to_device(self, copies: Sequence[Copy]) -> None:
        self._copy(copies, "cuMemcpyHtoDAsync")

    def _copy(self, copies: Sequence[Copy], fn: str) -> None:
        self._ensure_context()
        i = 0
        for copy in copies:
            for offset in range(0, copy.nbytes, self.chunk_bytes):
                n = min(self.chunk_bytes, copy.nbytes - offset)
                stream = self._streams[i % len(self._streams)]
                call(fn, copy.dst + offset, copy.src + offset, n, stream)
                i += 1
        self._wait()

    def _wait(self) -> None:
        for stream in self._streams:
            call("cuStreamSynchronize", stream)

    def content_hashes(self, spans: Sequence[Span]) -> list[bytes]:
        from dormant.memory.cuda_hash import hash_spans

        self._ensure_context()
        return hash_spans(spans, self.device)

    def pin(self, address: int, size: int) -> None:
        self._ensure_context()
        portable = driver().CU_MEMHOSTREGISTER_PORTABLE
        call("cuMemHostRegister", address, size, portable)

    def unpin(self, address: int, size: int) -> None:
        self._ensure_context()
        call("cuMemHostUnregister", address)
