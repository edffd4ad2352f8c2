"""One sleepable allocation: a reserved address range and, while it has one, its physical memory.

State machine of one allocation (DESIGN §2.3; the states are ``states.State``)::

    MAPPED ──unmap──▶ UNMAPPED ──release──▶ OFFLOADED (sleep HOST, after its copy landed)
                                       └──▶ DISCARDED (sleep DISCARD)
    UNMAPPED  ──wake: map the kept handle──▶ MAPPED   (contents intact)
    OFFLOADED ──wake: create, map, copy back──▶ MAPPED
    DISCARDED ──wake: create, map, zero/poison──▶ MAPPED
    any state ──free──▶ gone (VA released, host copy dropped, the handle released if held)

Every step is recorded as soon as its driver call returns, before the next call is made: an
``unmap`` that fails leaves the allocation MAPPED with its handle, a ``release`` that fails leaves
it UNMAPPED with its handle. The virtual address never changes while the allocation lives.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from dormant.memory.arena import Region
from dormant.memory.backend import Backend, Span
from dormant.memory.policy import Policy
from dormant.memory.ranges import align_up
from dormant.memory.states import State

_ids = itertools.count()


class Kind(enum.Enum):
    """How memory got into the allocation; the audit reports it."""

    TENSOR = "tensor"  # mm.empty / empty_many: declared backing
    ADOPTED = "adopted"  # mm.adopt: declared
    SLAB = "slab"  # holds small blocks of any kind
    RAW = "raw"  # mm.raw_alloc (capture scopes, allocator plugins): undeclared until declared


@dataclass(eq=False)
class Allocation:
    """A VA range of ``size`` bytes (a multiple of the granularity) in one tag.

    Invariants:
    - ``size`` is what is mapped, copied and hashed; ``reserved`` (≥ ``size``) is the VA range
      reserved for it. They differ only once a trimming slab rule shrank it (pool.py).
    - ``handle`` is the physical memory, held exactly in the MAPPED and UNMAPPED states; whenever
      a driver call fails the handle is kept, so it is never lost and never released twice.
    - ``pending`` is the policy of the sleep an UNMAPPED allocation is on its way into (None in
      every other state): a later sleep with that policy completes it, another conflicts.
    - ``region`` is the allocation's place in the host arena, kept for its lifetime once it has
      one. ``has_host_copy`` says the region holds a complete copy, and ``digest`` (when not
      None) is that copy's content hash. Both are cleared before a copy into the region starts
      and set only after it landed, so an OFFLOADED allocation whose copy never completed says so.
    """

    tag: str
    va: int
    size: int
    kind: Kind
    handle: int | None
    state: State = State.MAPPED
    pending: Policy | None = None
    region: Region | None = None
    has_host_copy: bool = False
    digest: bytes | None = None
    is_dirty: bool = False
    reserved: int = 0  # 0: ``size`` (set in __post_init__)
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        self.reserved = self.reserved or self.size

    @property
    def span(self) -> Span:
        return Span(self.va, self.size)

    @property
    def policy(self) -> Policy | None:
        """The policy this allocation is asleep with, or on its way into; None while MAPPED."""
        if self.state is State.OFFLOADED:
            return Policy.HOST
        if self.state is State.DISCARDED:
            return Policy.DISCARD
        return self.pending

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
    memory whose last tensor just died. Each step is recorded as it lands, so a failure leaves
    the allocation truthfully described (and still owning what it owns).
    """
    if allocation.state is State.MAPPED:
        backend.synchronize()
        backend.unmap(allocation.va, allocation.size)
        allocation.state = State.UNMAPPED
    if allocation.handle is not None:
        backend.release(allocation.handle)
        allocation.handle = None
    backend.free_reservation(allocation.va, allocation.reserved)
