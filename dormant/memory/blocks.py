"""Every live block of a manager, by tag and address, with its audit record.

Owns the per-tag pools and knows how a block's death propagates: the block returns to its pool,
and an allocation that dies with it gives back its VA and its host copy in the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch

from dormant.memory.allocation import Allocation, Kind, State, destroy_allocation
from dormant.memory.arena import HostArena
from dormant.memory.audit import AuditRecord, call_site
from dormant.memory.backend import Backend
from dormant.memory.errors import FreeFailedError
from dormant.memory.pool import Block, TagPool
from dormant.memory.release_history import ReleaseHistory
from dormant.memory.slab_rules import SlabRule


class BlockTable:
    """Invariants: ``_blocks`` holds exactly the blocks that are allocated and not yet freed;
    ``dying`` holds exactly the allocations that no block lives in and that are not yet
    destroyed (a driver call failed). They are in no pool: no sleep, wake or tag state sees them.
    """

    def __init__(
        self,
        backend: Backend,
        arena: HostArena,
        slab_bytes: int,
        max_slab_bytes: int,
        slab_rules: dict[str, SlabRule] | None = None,
    ) -> None:
        self.backend = backend
        self.arena = arena
        self._slab_bytes, self._max_slab_bytes = slab_bytes, max_slab_bytes
        self.slab_rules = dict(slab_rules or {})  # tags with a rule of their own
        self.pools: dict[str, TagPool] = {}
        self._blocks: dict[int, tuple[Block, AuditRecord]] = {}
        self.releases = ReleaseHistory()  # every release of physical memory, sleep's and free's
        self.dying: list[Allocation] = []  # no block left, destruction failed: retried

    def add_tag(self, tag: str, rule: SlabRule | None = None) -> None:
        """A pool for ``tag``: with ``rule``, else the tag's rule in ``slab_rules``, else the
        default one (``max_slab_bytes``)."""
        rule = rule or self.slab_rules.get(tag)
        self.pools[tag] = TagPool(
            self.backend, tag, self._slab_bytes, self._max_slab_bytes, rule=rule
        )

    def allocations(self, tags: Iterable[str] | None = None) -> Iterator[Allocation]:
        for tag in self.pools if tags is None else tags:
            yield from self.pools[tag].allocations

    def records(self) -> Iterator[AuditRecord]:
        return (record for _, record in self._blocks.values())

    def allocate(self, nbytes: int, tag: str, kind: Kind) -> Block:
        """A new block, recorded with its call site; raw blocks start undeclared."""
        block = self.pools[tag].allocate(nbytes, kind)
        site = call_site()
        record = AuditRecord(tag, block.address, nbytes, kind.value, site, kind is not Kind.RAW)
        self._blocks[block.address] = (block, record)
        return block

    def view(self, block: Block, on_free: Callable[[], None]) -> torch.Tensor:
        """A uint8 tensor over ``block`` whose storage's death calls ``on_free``; frees the block
        if the view cannot be made."""
        try:
            return self.backend.view(block.address, block.nbytes, on_free)
        except BaseException:
            self.free(block)
            raise

    def raw_block(self, address: int) -> Block:
        entry = self._blocks.get(address)
        if entry is None or entry[0].kind is not Kind.RAW:
            raise ValueError(f"{address:#x} is not a live raw allocation of this manager")
        return entry[0]

    def find(self, address: int) -> Block:
        """The block containing ``address``; ValueError if none does."""
        for block, record in self._blocks.values():
            if record.contains(address):
                return block
        raise ValueError(f"address {address:#x} is not memory of this MemoryManager")

    def tag_of(self, address: int) -> str | None:
        """The tag of the block containing ``address``; None if no block does."""
        try:
            return self.find(address).allocation.tag
        except ValueError:
            return None

    def mark_dirty(self, target: int | str) -> None:
        """Marks the allocation holding address ``target``, or every allocation of tag
        ``target``, for copying at the next sleep."""
        if isinstance(target, str):
            for allocation in self.pools[target].allocations:
                allocation.is_dirty = True
        else:
            self.find(target).allocation.is_dirty = True

    def declare(self, address: int) -> None:
        block = self.find(address)
        block_, record = self._blocks[block.address]
        self._blocks[block.address] = (block_, replace(record, is_declared=True))

    def free(self, block: Block) -> None:
        """Frees ``block`` in any state; its allocation's VA and host copy go if it was the last.

        A driver call that fails while that allocation is destroyed leaves it in ``dying``,
        described as the failure left it, and raises FreeFailedError: ``retry_frees`` finishes
        it. The block itself is gone either way (nothing can be placed in its allocation again).
        """
        del self._blocks[block.address]
        dead = self.pools[block.allocation.tag].free(block)
        if dead is not None:
            self._destroy(dead)

    def retry_frees(self) -> None:
        """Destroys every allocation in ``dying``; FreeFailedError at the first that fails again."""
        for allocation in list(self.dying):
            self._destroy(allocation)

    def _destroy(self, allocation: Allocation) -> None:
        if allocation.region is not None:  # a dead allocation's host copy is of no use
            self.arena.free(allocation.region)
            allocation.region, allocation.has_host_copy = None, False
        held_memory = allocation.handle is not None
        try:
            destroy_allocation(self.backend, allocation)
        except Exception as error:
            if allocation not in self.dying:
                self.dying.append(allocation)
            raise FreeFailedError(
                f"freeing {allocation.size:,} bytes of tag {allocation.tag!r} at "
                f"{allocation.va:#x} failed ({allocation.state.name}, handle "
                f"{'held' if allocation.handle is not None else 'released'}): {error}. The "
                "memory stays held and listed as unfreed in status(); the manager retries the "
                "free at its next call and at close()"
            ) from error
        finally:
            if held_memory and allocation.handle is None:
                self.releases.record(allocation.size)
        if allocation in self.dying:
            self.dying.remove(allocation)

    @property
    def unfreed_bytes(self) -> int:
        """Device memory still held by allocations whose free failed (``dying``)."""
        return sum(a.size for a in self.dying if a.handle is not None)

    @property
    def is_empty(self) -> bool:
        return not self._blocks and not any(self.allocations()) and not self.dying

    def drop_host_copies(self) -> None:
        """Frees every host copy and the arena, unless an allocation that is not MAPPED may still
        need its copy (offloaded, or unmapped on its way to being offloaded)."""
        allocations = list(self.allocations())
        if any(a.state is not State.MAPPED for a in allocations):
            return
        for allocation in allocations:
            if allocation.region is not None:
                self.arena.free(allocation.region)
                allocation.region, allocation.has_host_copy, allocation.digest = None, False, None
        self.arena.release()
