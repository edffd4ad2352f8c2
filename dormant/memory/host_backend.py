"""The ``host`` backend: DESIGN §2.7's semantics in host memory, for machines with no GPU and CI.

- reserve: ``mmap(PROT_NONE, MAP_NORESERVE)``; the address stays stable until freed.
- physical memory: a ``memfd`` of the allocation's size, mapped ``MAP_FIXED | MAP_SHARED``.
- unmap: maps ``PROT_NONE`` over the range again; release closes the fd, returning the pages.
- fresh pages read zero, as on the GPU. Touching unmapped memory is a segfault, as it is an
  illegal address on the GPU.
- ``capacity`` bounds the bytes of live physical memory, so tests can provoke OOM on wake.
- It is as strict as the driver: mapping a mapped range, unmapping an unmapped one, releasing an
  unknown handle or freeing a reservation that is still mapped raises ``DriverError``. It records
  its live handles, mappings and reservations (``live_handles`` and friends), so tests can check
  the manager's bookkeeping against what really exists.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import psutil
import torch

from dormant.memory import libc
from dormant.memory.backend import Copy, Span
from dormant.memory.copy_path import CopyPath
from dormant.memory.dlpack import tensor_at
from dormant.memory.errors import DriverError, OutOfMemoryError
from dormant.memory.sm_copy import sm_copy

_instances = itertools.count()
_CPU = torch.device("cpu")
_T = TypeVar("_T")


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
        self._mapped: dict[int, tuple[int, int]] = {}  # address -> (bytes, fd)
        self._reservations: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes of live physical memory (created and not yet released)."""
        with self._lock:
            return sum(self._sizes.values())

    def live_handles(self) -> dict[int, int]:
        """Handle → bytes, for every handle created and not yet released."""
        with self._lock:
            return dict(self._sizes)

    def mapped_ranges(self) -> dict[int, tuple[int, int]]:
        """Address → (bytes, handle), for every range mapped now."""
        with self._lock:
            return dict(self._mapped)

    def live_reservations(self) -> dict[int, int]:
        """Address → bytes, for every range reserved and not yet freed."""
        with self._lock:
            return dict(self._reservations)

    def reserve(self, size: int) -> int:
        va = _checked("reserve", libc.reserve, size)
        with self._lock:
            self._reservations[va] = size
        return va

    def free_reservation(self, va: int, size: int) -> None:
        with self._lock:
            if self._reservations.get(va) != size:
                raise DriverError(f"free_reservation: [{va:#x}, +{size}) is not a reservation")
            if any(va <= m < va + size for m in self._mapped):
                raise DriverError(f"free_reservation: [{va:#x}, +{size}) is still mapped")
        _checked("free_reservation (munmap)", libc.munmap, va, size)
        with self._lock:
            del self._reservations[va]

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
            fd = _checked("create (memfd_create)", os.memfd_create, "dormant", os.MFD_CLOEXEC)
            try:
                _checked("create (ftruncate)", os.ftruncate, fd, size)
            except BaseException:
                os.close(fd)
                raise
            self._sizes[fd] = size
            return fd

    def map(self, va: int, size: int, handle: int) -> None:
        with self._lock:
            if handle not in self._sizes:
                raise DriverError(f"map: {handle} is not a live handle")
            if va in self._mapped:
                raise DriverError(f"map: {va:#x} is already mapped")
        _checked("map (mmap MAP_FIXED)", libc.map_shared_fixed, va, size, handle)
        with self._lock:
            self._mapped[va] = (size, handle)

    def unmap(self, va: int, size: int) -> None:
        with self._lock:
            if self._mapped.get(va, (None,))[0] != size:
                raise DriverError(f"unmap: [{va:#x}, +{size}) is not mapped")
        _checked("unmap (mmap PROT_NONE)", libc.reserve_fixed, va, size)
        with self._lock:
            del self._mapped[va]

    def release(self, handle: int) -> None:
        with self._lock:
            if handle not in self._sizes:
                raise DriverError(f"release: {handle} is not a live handle")
        _checked("release (close)", os.close, handle)
        with self._lock:
            del self._sizes[handle]

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

    def copy_batch(self, path: CopyPath = CopyPath.COPY_ENGINE) -> _ImmediateCopies:
        """COPY_ENGINE: memmove; SM: the SM path's elementwise kernels (sm_copy.py) on CPU
        tensors, so the CPU tests run its pieces."""
        if path is CopyPath.HYBRID:
            raise ValueError("a backend batch copies by one path; HYBRID is two (path_copies.py)")
        return _ImmediateCopies(path)

    def hash_batch(self) -> _ImmediateHashes:
        return _ImmediateHashes()

    def pin(self, address: int, size: int) -> None:
        """Host memory needs no registration."""

    def unpin(self, address: int, size: int) -> None:
        """Host memory needs no registration."""


class _ImmediateCopies:
    """Host copies are memmoves (or elementwise kernels, for SM): each has landed when ``add``
    returns."""

    def __init__(self, path: CopyPath) -> None:
        self._count = 0
        self._path = path

    def add(self, copy: Copy) -> int:
        if self._path is CopyPath.SM:
            sm_copy(copy.dst, copy.src, copy.nbytes, _CPU)
        else:
            ctypes.memmove(copy.dst, copy.src, copy.nbytes)
        self._count += 1
        return self._count - 1

    def wait(self, index: int) -> None:
        if not 0 <= index < self._count:
            raise IndexError(index)

    def wait_all(self) -> None:
        """Every copy already landed."""


class _ImmediateHashes:
    """Host hashes (BLAKE2b, 128 bits) are computed when a group is added."""

    def __init__(self) -> None:
        self._groups: list[list[bytes]] = []

    def add(self, spans: Sequence[Span]) -> int:
        digests = []
        for span in spans:
            buffer = (ctypes.c_char * span.nbytes).from_address(span.address)
            digests.append(hashlib.blake2b(memoryview(buffer), digest_size=16).digest())
        self._groups.append(digests)
        return len(self._groups) - 1

    def wait(self, index: int) -> list[bytes]:
        return self._groups[index]


def _checked(call: str, function: Callable[..., _T], *args: object) -> _T:
    """``function(*args)``, with an OSError raised as the DriverError a device would raise."""
    try:
        return function(*args)
    except OSError as error:
        raise DriverError(f"{call} failed: {error}") from error
