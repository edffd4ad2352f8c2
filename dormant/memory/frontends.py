"""The allocation side of a manager (DESIGN §2.4): its gate, its tags, and blocks in and out.

``MemoryManager`` is the facade; this holds what its frontends share. ``op()`` is the gate every
operation passes (the manager's lock, not closed, the CUDA context usable); ``empty_many`` and
``raw_alloc`` hand out blocks of a tag, and a block returns when its last tensor storage dies
(``_on_storage_freed``, from any thread) or on ``raw_free``. After ``close`` frees still land,
and the last one releases the arena.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import torch

from dormant.memory.adopt import Shape, pack_views, tensor_specs
from dormant.memory.allocation import Kind
from dormant.memory.audit import AuditReport, make_report
from dormant.memory.blocks import BlockTable
from dormant.memory.context_release import ContextRelease
from dormant.memory.errors import FreeFailedError, ManagerClosedError
from dormant.memory.policy import Policy, as_tag_list, audited_tags
from dormant.memory.pool import BLOCK_ALIGNMENT, Block
from dormant.memory.serial import SerialSection
from dormant.memory.slab_rules import InvalidSlabRuleError, SlabRule
from dormant.memory.tag_machine import check_can_allocate, check_known

logger = logging.getLogger(__name__)


class Frontends:
    """Invariant: every block handed out is in ``table`` until it is freed, exactly once."""

    def __init__(self, table: BlockTable, serial: SerialSection, context: ContextRelease) -> None:
        self.table, self.serial, self.context = table, serial, context
        self.user_tags: dict[str, dict[int, Policy]] = {}  # tag -> its policy per level
        self.is_closed = False

    @contextmanager
    def op(self) -> Iterator[None]:
        """The gate: frees that failed earlier are retried first, and one that fails again
        raises FreeFailedError before the operation changes anything."""
        with self.serial.held():
            self.check_open()
            self.context.check_usable("this MemoryManager call")
            self.table.retry_frees()
            yield

    def close(self) -> FreeFailedError | None:
        """Stops new operations (under the lock); returns the error of a failed free that failed
        again at its retry, if any. The arena goes now if nothing is left, else at the last free.
        """
        self.is_closed = True
        try:
            self.table.retry_frees()
        except FreeFailedError as error:
            return error
        finally:
            if self.table.is_empty:
                self.table.arena.release()
        return None

    def check_open(self) -> None:
        if self.is_closed:
            raise ManagerClosedError("this MemoryManager was closed; create a new one")

    def check_tags(self, tags: Iterable[str]) -> list[str]:
        return check_known(self.table.pools, tags)

    def register_tag(
        self, tag: str, levels: Mapping[int, Policy | str] | None, slab_rule: SlabRule | None
    ) -> None:
        """Adds a user tag; a bad argument raises and adds nothing."""
        with self.op():
            if tag in self.table.pools:
                raise ValueError(f"tag {tag!r} already exists; tags: {list(self.table.pools)}")
            per_level = {int(k): Policy.parse(v) for k, v in (levels or {}).items()}
            if slab_rule is not None and not isinstance(slab_rule, SlabRule):
                raise InvalidSlabRuleError(f"slab_rule must be a SlabRule, got {slab_rule!r}")
            self.user_tags[tag] = per_level
            self.table.add_tag(tag, slab_rule)

    def audit(self, tags: Iterable[str] | None) -> AuditReport:
        with self.op():
            names = None if tags is None else self.check_tags(as_tag_list(tags))
            wanted = audited_tags(names, self.user_tags, self.table.pools)
            return make_report(r for r in self.table.records() if r.tag in wanted)

    def mark_dirty(self, target: torch.Tensor | str) -> None:
        with self.op():
            self.table.mark_dirty(
                self.check_tags([target])[0] if isinstance(target, str) else target.data_ptr()
            )

    def declare_backing(self, memory: torch.Tensor | int) -> None:
        address = memory if isinstance(memory, int) else memory.data_ptr()
        with self.op():
            self.table.declare(address)

    def empty_many(
        self, specs: Sequence[tuple[Shape, torch.dtype]], tag: str, kind: Kind
    ) -> list[torch.Tensor]:
        """Tensors packed into one block of ``tag``, freed when the last of them dies."""
        layout, nbytes = tensor_specs(specs, BLOCK_ALIGNMENT)
        with self.op():
            if nbytes == 0:
                self.check_tags([tag])
                device = self.table.backend.device
                return [torch.empty(s, dtype=d, device=device) for s, d in specs]
            block = self._allocate(nbytes, tag, kind)
            raw = self.table.view(block, partial(self._on_storage_freed, block))
        return pack_views(raw, specs, layout)

    def raw_alloc(self, nbytes: int, tag: str) -> int:
        with self.op():
            return self._allocate(max(nbytes, 1), tag, Kind.RAW).address

    def raw_free(self, address: int) -> None:
        with self.serial.held():
            self._free_block(self.table.raw_block(address), quiet=False)

    def _allocate(self, nbytes: int, tag: str, kind: Kind) -> Block:
        self.check_tags([tag])
        check_can_allocate(self.table.pools[tag])
        return self.table.allocate(nbytes, tag, kind)

    def _on_storage_freed(self, block: Block) -> None:
        """Deleter of a tensor storage; may run on any thread, even inside one of our own calls."""
        self.serial.defer(partial(self._free_block, block, quiet=True))

    def _free_block(self, block: Block, quiet: bool) -> None:
        """Frees ``block``. A free that fails is kept for a retry (blocks.py) and raised to the
        caller that asked for it (``raw_free``); with nobody to take it (a deleter, a restore,
        another call's exit) it is logged, and the next call that retries it raises."""
        if self.context.defer(partial(self._free_block, block, quiet=True)):
            return  # the driver is locked (context released): it runs after the restore
        try:
            self.table.free(block)
            if self.is_closed:
                self.table.retry_frees()  # no call will come to retry them
        except FreeFailedError as error:
            if not quiet:
                raise
            logger.warning("%s", error)
        finally:
            if self.is_closed and self.table.is_empty:
                self.table.arena.release()
