"""The small protocol between the manager and a device (DESIGN §2.7).

The manager never branches on which backend it has, except through this protocol. A backend knows
how to reserve address ranges, create and map physical memory, view memory as torch tensors, and
move bytes; it knows nothing of tags, policies or states. ``backends.open_backend`` picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from dormant.memory.copy_path import CopyPath


class Copy(NamedTuple):
    """One copy of ``nbytes`` from ``src`` to ``dst`` (raw addresses)."""

    dst: int
    src: int
    nbytes: int


class Span(NamedTuple):
    """``nbytes`` of memory at ``address``."""

    address: int
    nbytes: int


class CopyBatch(Protocol):
    """Copies issued one by one and waited for individually or all together.

    ``add`` starts a copy and returns its index; ``wait(i)`` returns once copy ``i`` has landed;
    ``wait_all`` once every copy has. A batch is waited for completely before it is dropped.
    """

    def add(self, copy: Copy) -> int: ...
    def wait(self, index: int) -> None: ...
    def wait_all(self) -> None: ...


class HashBatch(Protocol):
    """Content hashes computed asynchronously, one group of spans at a time.

    ``add(spans)`` starts hashing a group where the memory lives and returns its index;
    ``wait(i)`` returns group ``i``'s digests (≥128 bits each, one per span, in order) once they
    are known. Groups are hashed in the order they were added, so the caller can work on the
    first group's results while the device still hashes the next ones.
    """

    def add(self, spans: Sequence[Span]) -> int: ...
    def wait(self, index: int) -> list[bytes]: ...


class Backend(Protocol):
    """A device whose memory can be reserved, mapped, unmapped and released separately.

    Contract:
    - ``reserve`` returns a range no one else uses, aligned to ``granularity``; it stays reserved
      until ``free_reservation``.
    - ``create`` raises ``OutOfMemoryError`` (and changes nothing) when memory is short.
    - ``map`` makes ``[va, va + size)`` read-write backed by ``handle``; ``unmap`` makes the range
      inaccessible again but keeps it reserved. Freshly created memory reads as zero.
    - ``fill`` returns only when the bytes have landed; ``copy_batch`` copies asynchronously
      between device and registered host memory, in either direction, by the copy engines or
      (``CopyPath.SM``) by kernels; the two paths' batches run on streams of their own, so one
      of each may be open at once (HYBRID, path_copies.py). Bit-exact either way.
    - A call that fails raises (``DriverError`` naming the call, or ``OutOfMemoryError``) and has
      not done its work: a failed ``unmap`` leaves the range mapped, a failed ``release`` leaves
      the handle alive, a failed ``map`` leaves the range unmapped. The caller keeps its records.
    """

    name: str
    device: torch.device
    device_key: str
    granularity: int

    def reserve(self, size: int) -> int: ...
    def free_reservation(self, va: int, size: int) -> None: ...
    def create(self, size: int) -> int: ...
    def map(self, va: int, size: int, handle: int) -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def release(self, handle: int) -> None: ...
    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        ...

    def other_usage(self) -> dict[str, int]:
        """Device memory held by known owners other than the manager, by owner."""
        ...

    def synchronize(self) -> None:
        """Waits for all work on the device, on every stream."""
        ...

    def view(self, va: int, nbytes: int, on_free: Callable[[], None]) -> torch.Tensor: ...
    def fill(self, spans: Sequence[Span], value: int) -> None: ...
    def copy_batch(self, path: CopyPath = CopyPath.COPY_ENGINE) -> CopyBatch:
        """A batch copying by ``path``: COPY_ENGINE or SM (HYBRID is two batches)."""
        ...

    def hash_batch(self) -> HashBatch:
        """Content hashes of device memory, computed where the memory lives (see HashBatch)."""
        ...

    def pin(self, address: int, size: int) -> None:
        """Registers host memory for fast asynchronous copies (a no-op where none is needed)."""
        ...

    def unpin(self, address: int, size: int) -> None: ...
