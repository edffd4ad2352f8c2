"""The memory of one tag: few large physical handles, each carved into many blocks.

A *block* is what one frontend call gets: one tensor storage, or one ``raw_alloc`` (a segment of
a CUDA-graph pool or a capture scope). Sleep and wake cost driver calls per *allocation* (one
physical handle each: ~45 µs of unmap + release from Python, the same again for create + map), so
small blocks are coalesced: every block below ``coalesce_limit`` is carved out of a *slab*, an
allocation shared with other blocks of its tag. 4096 blocks of 2 MiB then sleep as ~80 handles.

Slab sizes grow with the tag::

    new slab = clamp(pow2_floor(bytes already in this tag's slabs / SLAB_GROWTH),
                     slab_bytes, max_slab_bytes), or the block's own size if that is larger

so a tag never holds more than 1/SLAB_GROWTH of its slab bytes in a slab it has only begun to
fill, plus what freed blocks leave behind (a slab's physical memory returns only once all of its
blocks are gone). Blocks of at least ``coalesce_limit`` = max_slab_bytes / 16 get an allocation
of their own: at most 1/16 of a slab is then lost at its end to a block that did not fit.

That is the default ``SlabRule``; a tag may have its own (``slab_rules.py``): the ``weights`` tag
coalesces every block below 2 GiB, grows its slabs by half of what it holds, and ``trim``s each
slab's unused tail once it sleeps (the allocation's ``size`` shrinks; its VA reservation stays).
"""

from __future__ import annotations

from dataclasses import dataclass

from dormant.memory.allocation import Allocation, Kind, create_allocation
from dormant.memory.backend import Backend
from dormant.memory.ranges import RangeAllocator, align_up
from dormant.memory.slab_rules import SlabRule

BLOCK_ALIGNMENT = 256
SLAB_GROWTH = 8
COALESCE_FRACTION = 16  # the default rule's (slab_rules.DEFAULT_COALESCE_FRACTION)


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
    """Allocations of one tag, sized by ``rule`` (default: ``SlabRule(max_slab_bytes)``).

    Invariant: every slab's allocation is in ``allocations``, and its range allocator spans
    exactly that allocation's ``size``.
    """

    def __init__(
        self,
        backend: Backend,
        tag: str,
        slab_bytes: int,
        max_slab_bytes: int | None = None,
        rule: SlabRule | None = None,
    ) -> None:
        self._backend = backend
        self.tag = tag
        self.slab_bytes = align_up(slab_bytes, backend.granularity)
        largest = self.slab_bytes if max_slab_bytes is None else max_slab_bytes
        self.rule = SlabRule(largest, coalesce_fraction=COALESCE_FRACTION) if rule is None else rule
        self.max_slab_bytes = max(
            align_up(self.rule.max_slab_bytes, backend.granularity), self.slab_bytes
        )
        self.allocations: list[Allocation] = []
        self._slabs: list[Slab] = []

    @property
    def coalesce_limit(self) -> int:
        """Blocks below this many bytes are carved from slabs."""
        return max(self.max_slab_bytes // self.rule.coalesce_fraction, self.slab_bytes // 4)

    @property
    def used_bytes(self) -> int:
        """Bytes in live blocks (the rest of ``allocations`` is slab space nobody uses)."""
        in_slabs = {id(s.allocation) for s in self._slabs}
        own = sum(a.size for a in self.allocations if id(a) not in in_slabs)
        return own + sum(s.ranges.allocated_bytes for s in self._slabs)

    def allocate(self, nbytes: int, kind: Kind) -> Block:
        """A new block of ``nbytes``; OutOfMemoryError (changing nothing) if memory is short."""
        if nbytes < self.coalesce_limit:
            return self._allocate_in_slab(nbytes, kind)
        allocation = create_allocation(self._backend, self.tag, nbytes, kind)
        self.allocations.append(allocation)
        return Block(allocation.va, nbytes, kind, allocation, None)

    def free(self, block: Block) -> Allocation | None:
        """Returns a block. When nothing else lives in its allocation, the allocation leaves the
        pool (no block is placed in it again) and is returned for the caller to destroy."""
        if block.slab is None:
            self.allocations.remove(block.allocation)
            return block.allocation
        block.slab.ranges.free(block.address - block.allocation.va)
        if not block.slab.ranges.is_empty:
            return None
        self._slabs.remove(block.slab)
        self.allocations.remove(block.slab.allocation)
        return block.slab.allocation

    def next_slab_bytes(self, nbytes: int) -> int:
        """The size of the slab a block of ``nbytes`` that fits in no slab would get."""
        held = sum(s.allocation.size for s in self._slabs)
        growth = SLAB_GROWTH if self.rule.growth is None else self.rule.growth  # read now: tests
        grown = 1 << max((held // growth).bit_length() - 1, 0)  # set SLAB_GROWTH
        size = min(max(grown, self.slab_bytes), self.max_slab_bytes)
        return max(align_up(size, self._backend.granularity), align_up(nbytes, BLOCK_ALIGNMENT))

    def trim(self) -> int:
        """Under a trimming rule, shrinks every slab that holds no physical memory (asleep) to
        its last block, rounded up to the granularity: the wake creates only that much, and no
        block is placed past it again. Its arena copy stays valid; its digest is dropped (it
        hashed the longer span), so the next sleep copies it once more. Returns the bytes
        trimmed. Precondition: no block is being allocated (the tag is asleep)."""
        if not self.rule.trims:
            return 0
        trimmed = 0
        for slab in self._slabs:
            allocation = slab.allocation
            if allocation.handle is not None:
                continue
            end = align_up(max(slab.ranges.high_water, 1), self._backend.granularity)
            if end < allocation.size:
                slab.ranges.shrink(end)
                trimmed += allocation.size - end
                allocation.size, allocation.digest = end, None
        return trimmed

    def _allocate_in_slab(self, nbytes: int, kind: Kind) -> Block:
        for slab in self._slabs:  # first fit: gaps left by larger blocks fill with smaller ones
            offset = slab.ranges.allocate(nbytes)
            if offset is not None:
                return Block(slab.allocation.va + offset, nbytes, kind, slab.allocation, slab)
        size = self.next_slab_bytes(nbytes)
        allocation = create_allocation(self._backend, self.tag, size, Kind.SLAB)
        slab = Slab(allocation, RangeAllocator(allocation.size, BLOCK_ALIGNMENT))
        self.allocations.append(allocation)
        self._slabs.append(slab)
        offset = slab.ranges.allocate(nbytes)
        assert offset == 0
        return Block(allocation.va, nbytes, kind, allocation, slab)
