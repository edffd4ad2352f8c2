"""One sleepable allocation: a reserved address range and, while mapped, its physical memory.

State machine of one allocation (DESIGN §2.3)::

    MAPPED ──sleep HOST──▶ OFFLOADED ──wake──▶ MAPPED
    MAPPED ──sleep DISCARD─▶ DISCARDED ──wake──▶ MAPPED
    any state ──free──▶ (gone: VA released, host copy dropped; physical memory only if MAPPED)

The virtual address never changes while the allocation lives; only the physical memory behind it
comes and goes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from dormant.memory.arena import Region
from dormant.memory.backend import Backend, Span
from dormant.memory.ranges import align_up

_ids = itertools.count()


class State(enum.Enum):
    MAPPED = "mapped"
    OFFLOADED = "offloaded"
    DISCARDED = "discarded"


class Kind(enum.Enum):
    """How memory got into the allocation; the audit reports it."""

    TENSOR = "tensor"  # mm.empty / empty_many: declared backing
    ADOPTED = "adopted"  # mm.adopt: declared
    SLAB = "slab"  # holds small blocks of any kind
    RAW = "raw"  # mm.raw_alloc (capture scopes, allocator plugins): undeclared until declared


@dataclass(eq=False)
class Allocation:
    """A VA range of ``size`` bytes (a multiple of the granularity) in one tag.

    ``region`` and ``digest`` describe the host copy: ``digest`` is the content hash of the bytes
    in ``region``, or None when the region holds no valid copy. While MAPPED, ``handle`` is the
    physical memory; otherwise it is None.
    """

    tag: str
    va: int
    size: int
    kind: Kind
    handle: object | None
    state: State = State.MAPPED
    region: Region | None = None
    digest: bytes | None = None
    is_dirty: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def span(self) -> Span:
        return Span(self.va, self.size)

    def contains(self, address: int) -> bool:
        return self.va <= address < self.va + self.size


def create_allocation(backend: Backend, tag: str, nbytes: int, kind: Kind) -> Allocation:
    """Reserves, creates and maps ``nbytes`` rounded up to the granularity; all or nothing."""
    size = align_up(max(nbytes, 1), backend.granularity)
    va = backend.reserve(size)
    try:
        handle = backend.create(size)
        try:
            backend.map(va, size, handle)
        except BaseException:
            backend.release(handle)
            raise
    except BaseException:
        backend.free_reservation(va, size)
        raise
    return Allocation(tag=tag, va=va, size=size, kind=kind, handle=handle)


def destroy_allocation(backend: Backend, allocation: Allocation) -> None:
    """Frees the allocation in any state; never releases anything twice.

    A mapped allocation is unmapped only after the device is idle: a kernel may still be reading
    memory whose last tensor just died.
    """
    if allocation.state is State.MAPPED:
        backend.synchronize()
        backend.unmap(allocation.va, allocation.size)
        backend.release(allocation.handle)
    allocation.handle = None
    backend.free_reservation(allocation.va, allocation.size)
