"""The memory of one tag: dedicated allocations for large blocks, slabs for small ones.

A *block* is what one frontend call gets: one tensor storage. Blocks of at least a quarter slab
get an allocation of their own (few, large handles); smaller ones are carved out of a per-tag slab
instead of costing a 2 MiB handle each.
"""

from __future__ import annotations

from dataclasses import dataclass

from dormant.memory.allocation import Allocation, Kind, create_allocation, destroy_allocation
from dormant.memory.backend import Backend
from dormant.memory.ranges import RangeAllocator, align_up

BLOCK_ALIGNMENT = 256


@dataclass(eq=False)
class Slab:
    allocation: Allocation
    ranges: RangeAllocator


@dataclass(frozen=True, eq=False)
class Block:
    """``nbytes`` at ``address``, inside ``allocation``: a whole allocation of its own, or, when
    ``slab`` is set, a range carved from that slab's allocation."""

    address: int
    nbytes: int
    kind: Kind
    allocation: Allocation
    slab: Slab | None


class TagPool:
    """Allocations of one tag. Invariant: every slab's allocation is in ``allocations``."""

    def __init__(self, backend: Backend, tag: str, slab_bytes: int) -> None:
        self._backend = backend
        self.tag = tag
        self.slab_bytes = align_up(slab_bytes, backend.granularity)
        self.allocations: list[Allocation] = []
        self._slabs: list[Slab] = []

    @property
    def small_limit(self) -> int:
        """Blocks below this many bytes go to a slab."""
        return self.slab_bytes // 4

    def allocate(self, nbytes: int, kind: Kind) -> Block:
        """A new block of ``nbytes``; OutOfMemoryError (changing nothing) if memory is short."""
        if nbytes < self.small_limit:
            return self._allocate_small(nbytes, kind)
        allocation = create_allocation(self._backend, self.tag, nbytes, kind)
        self.allocations.append(allocation)
        return Block(allocation.va, nbytes, kind, allocation, None)

    def free(self, block: Block) -> Allocation | None:
        """Returns a block; frees its allocation when nothing else lives in it.

        Returns the allocation it destroyed, if any, so the caller can drop its host copy.
        """
        if block.slab is None:
            self._destroy(block.allocation)
            return block.allocation
        block.slab.ranges.free(block.address - block.allocation.va)
        if not block.slab.ranges.is_empty:
            return None
        self._destroy(block.slab.allocation)
        self._slabs.remove(block.slab)
        return block.slab.allocation

    def _allocate_small(self, nbytes: int, kind: Kind) -> Block:
        for slab in self._slabs:
            offset = slab.ranges.allocate(nbytes)
            if offset is not None:
                return Block(slab.allocation.va + offset, nbytes, kind, slab.allocation, slab)
        allocation = create_allocation(self._backend, self.tag, self.slab_bytes, Kind.SLAB)
        slab = Slab(allocation, RangeAllocator(allocation.size, BLOCK_ALIGNMENT))
        self.allocations.append(allocation)
        self._slabs.append(slab)
        offset = slab.ranges.allocate(nbytes)
        assert offset == 0
        return Block(allocation.va, nbytes, kind, allocation, slab)

    def _destroy(self, allocation: Allocation) -> None:
        destroy_allocation(self._backend, allocation)  # a failure leaves it listed, as it is
        self.allocations.remove(allocation)
