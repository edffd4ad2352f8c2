"""The ``host`` backend: DESIGN §2.7's semantics in host memory, for machines with no GPU and CI.

- reserve: ``mmap(PROT_NONE, MAP_NORESERVE)``; the address stays stable until freed.
- physical memory: a ``memfd`` of the allocation's size, mapped ``MAP_FIXED | MAP_SHARED``.
- unmap: maps ``PROT_NONE`` over the range again; release closes the fd, returning the pages.
- fresh pages read zero, as on the GPU. Touching unmapped memory is a segfault, as it is an
  illegal address on the GPU.
- ``capacity`` bounds the bytes of live physical memory, so tests can provoke OOM on wake.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import psutil
import torch

from dormant.memory import libc
from dormant.memory.backend import Copy, Span
from dormant.memory.dlpack import tensor_at
from dormant.memory.errors import OutOfMemoryError

_instances = itertools.count()


class HostBackend:
    """Emulates a device in host memory; each instance is a device of its own capacity."""

    name = "host"

    def __init__(self, capacity: int | None = None, granularity: int = 2 << 20) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        if granularity <= 0 or granularity % page:
            raise ValueError(
                f"granularity must be a positive multiple of {page}, got {granularity}"
            )
        self.device = torch.device("cpu")
        self.device_key = f"host:{next(_instances)}"
        self.granularity = granularity
        self.capacity = capacity
        self._sizes: dict[int, int] = {}  # fd -> bytes
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes of live physical memory (created and not yet released)."""
        with self._lock:
            return sum(self._sizes.values())

    def reserve(self, size: int) -> int:
        return libc.reserve(size)

    def free_reservation(self, va: int, size: int) -> None:
        libc.munmap(va, size)

    def create(self, size: int) -> int:
        with self._lock:
            used = sum(self._sizes.values())
            if self.capacity is not None and used + size > self.capacity:
                free = self.capacity - used
                raise OutOfMemoryError(
                    f"host backend out of memory: asked for {size} bytes, {free} free of "
                    f"capacity {self.capacity}",
                    bytes_requested=size,
                    bytes_free=free,
                )
            fd = os.memfd_create("dormant", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                raise
            self._sizes[fd] = size
            return fd

    def map(self, va: int, size: int, handle: int) -> None:
        libc.map_shared_fixed(va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        libc.reserve_fixed(va, size)

    def release(self, handle: int) -> None:
        with self._lock:
            del self._sizes[handle]
        os.close(handle)

    def memory_info(self) -> tuple[int, int]:
        """The emulated device holds only what this backend created (bounded by ``capacity``)."""
        total = psutil.virtual_memory().total if self.capacity is None else self.capacity
        return total - self.used_bytes, total

    def other_usage(self) -> dict[str, int]:
        return {}

    def synchronize(self) -> None:
        """Host memory has no queued work: nothing to wait for."""

    def view(self, va: int, nbytes: int, on_free: Callable[[], None]) -> torch.Tensor:
        return tensor_at(va, nbytes, self.device, on_free)

    def fill(self, spans: Sequence[Span], value: int) -> None:
        for span in spans:
            libc.memset(span.address, value, span.nbytes)

    def copy_batch(self) -> _ImmediateCopies:
        return _ImmediateCopies()

    def content_hashes(self, spans: Sequence[Span]) -> list[bytes]:
        digests = []
        for span in spans:
            buffer = (ctypes.c_char * span.nbytes).from_address(span.address)
            digests.append(hashlib.blake2b(memoryview(buffer), digest_size=16).digest())
        return digests

    def pin(self, address: int, size: int) -> None:
        """Host memory needs no registration."""

    def unpin(self, address: int, size: int) -> None:
        """Host memory needs no registration."""


class _ImmediateCopies:
    """Host copies are plain memmoves: each has landed when ``add`` returns."""

    def __init__(self) -> None:
        self._count = 0

    def add(self, copy: Copy) -> int:
        ctypes.memmove(copy.dst, copy.src, copy.nbytes)
        self._count += 1
        return self._count - 1

    def wait(self, index: int) -> None:
        if not 0 <= index < self._count:
            raise IndexError(index)

    def wait_all(self) -> None:
        """Every copy already landed."""
