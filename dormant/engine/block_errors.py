"""The block manager's typed errors. Each is raised before its call changes anything, so a
caller that checks first (``can_allocate``, ``can_fork``, ``can_grow``, ``can_append``) never
sees ``OutOfBlocksError``, and one that does may retry once blocks are freed.

``BlockManagerError`` is the base (``dormant.engine`` exports it); ``check_invariant`` raises it
itself when the ownership invariant is broken, which is a bug in the engine, not misuse.
"""

from __future__ import annotations

from dormant.errors import EngineError


class BlockManagerError(EngineError):
    """Base class for misuse of the block manager."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free blocks; check ``can_allocate`` / ``can_append`` first."""


class AlreadyAllocatedError(BlockManagerError):
    """``allocate`` was called for a sequence that already holds blocks."""


class BlockOwnershipError(BlockManagerError):
    """A block table names blocks this manager did not give to that sequence."""
